"""The README's Python snippet runs as written, given the names it assumes (keys, values, ids,
vocab, model, tokenizer, prompt) from a tiny random model; the one-liner's budget of 0.25 is met
(real-model version: tests/test_generate_budgets_real.py)."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
from test_hf_utils import one_thread, tiny_model, tiny_tokenizer  # noqa: E402,F401  (autouse fixture)

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_snippet_runs(capsys):
    import kvcompress

    (block,) = re.findall(r"^```python\n(.*?)^```", README.read_text(), re.S | re.M)
    gen = torch.Generator().manual_seed(0)
    vocab = ("hello", " world", ".", ",", " the", "\n", " cat", " sat", " on", " mat")
    ids = torch.randint(0, len(vocab), (1, 80), generator=gen)
    keys, values = torch.randn(1, 2, 80, 8, generator=gen), torch.randn(1, 2, 80, 8, generator=gen)
    tokenizer = tiny_tokenizer()
    model = tiny_model(seed=1)
    prompt = " ".join(["the secret code word is pineapple ."] * 12 + ["What is the code word ?"])
    namespace = {"keys": keys, "values": values, "ids": ids, "vocab": vocab, "model": model,
                 "tokenizer": tokenizer, "prompt": prompt}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", kvcompress.BudgetWarning)
        exec(compile(block, "README.md", "exec"), namespace)
    assert "report" in namespace and "info" in namespace and isinstance(namespace["text"], str)
    info = namespace["info"]
    assert info["budget_met"] and info["keep_reached"] <= 0.25 + 1e-9
    assert capsys.readouterr().out.strip()  # the snippet prints the report
