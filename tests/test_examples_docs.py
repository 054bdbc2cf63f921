"""The docs are true of the code: every ```python block of the guides runs (blocks of one page in
order, sharing a namespace; ```py blocks need a model or a plugin and are not run), the config
reference lists every PipelineConfig field, and relative links point at files that exist."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

import kvcompress as kc
from kvcompress import presets as presets_module

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
GUIDES = ["index.md", "architecture.md", "chunkers.md", "clusterers.md", "mergers.md",
          "guards-and-scorers.md", "config.md", "writing-a-strategy.md"]
LATER = {"results.md", "performance.md", "strategies.md"}  # written by others; linked already


def python_blocks(page: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", (DOCS / page).read_text(), re.S | re.M)


@pytest.mark.parametrize("page", GUIDES)
def test_python_blocks_run(page, capsys):
    blocks = python_blocks(page)
    assert blocks or page in ("index.md",), f"{page} has no runnable example"
    before = set(presets_module._PRESETS)
    namespace = {"__name__": f"docs_{page}"}
    try:
        for i, block in enumerate(blocks):
            exec(compile(block, f"docs/{page} block {i}", "exec", dont_inherit=True), namespace)
    finally:
        for name in set(presets_module._PRESETS) - before:  # presets a page registers
            presets_module._PRESETS.pop(name)


def test_config_reference_lists_every_field():
    text = (DOCS / "config.md").read_text()
    table = {m.group(1) for m in re.finditer(r"^\| `(\w+)` \| ", text, re.M)}
    fields = {f.name for f in dataclasses.fields(kc.PipelineConfig)}
    assert fields <= table, f"fields missing from docs/config.md: {sorted(fields - table)}"
    defaults = kc.PipelineConfig()
    for f in ("keep_ratio", "sinks", "recent", "max_rounds", "recompress_every", "query_window"):
        row = re.search(rf"^\| `{f}` \| `([^`]*)` \|", text, re.M)
        assert row and row.group(1) == repr(getattr(defaults, f)), f


def test_config_reference_lists_every_builtin_preset():
    text = (DOCS / "config.md").read_text()
    builtin = [p for p in kc.list_presets() if p != "windowed-average"]  # the plugin's, if installed
    for name in builtin:
        short = "-" + name.split("-", 1)[1] if "-" in name else name
        assert f"`{name}`" in text or f"`{short}`" in text, name


@pytest.mark.parametrize("page", GUIDES)
def test_relative_links_resolve(page):
    text = (DOCS / page).read_text()
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
        if target in LATER:
            continue
        assert (DOCS / target).resolve().exists(), f"{page} links to missing {target}"


def test_strategy_pages_cover_every_registered_strategy():
    pages = {"chunker": "chunkers.md", "clusterer": "clusterers.md", "merger": "mergers.md",
             "scorer": "guards-and-scorers.md"}
    plugin = {"windowed-average"}
    for kind, names in kc.list_strategies().items():
        if kind not in pages:
            continue
        text = (DOCS / pages[kind]).read_text()
        for name in set(names) - plugin:
            if name.startswith("test-"):
                continue
            assert f"`{name}`" in text, f"{kind} {name!r} is not documented in docs/{pages[kind]}"
