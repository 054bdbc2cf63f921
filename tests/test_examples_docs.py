"""The docs are true of the code: every ```python block of the guides runs (blocks of one page in
order, sharing a namespace; ```py blocks need a model or a plugin and are not run), the config
reference lists every PipelineConfig field, and relative links point at files that exist."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import pytest

import kvcompress as kc
from kvcompress import presets as presets_module

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
GUIDES = ["index.md", "architecture.md", "chunkers.md", "clusterers.md", "mergers.md",
          "guards-and-scorers.md", "config.md", "writing-a-strategy.md", "vllm.md", "usage.md"]
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


PARAM_PAGES = {"chunker": "chunkers.md", "clusterer": "clusterers.md", "merger": "mergers.md",
               "scorer": "guards-and-scorers.md", "guard": "guards-and-scorers.md"}
_ROW = re.compile(r"^\| `([^`]+)` \| `([^`]+)` \|", re.M)


def documented_parameters(page: str, names: set[str]) -> dict[str, dict[str, str]]:
    """{strategy: {parameter: default text}} from the tables under '## `name`' / '### `name`'
    headings (a heading may name several strategies, e.g. '## `mean` and `degree`')."""
    out: dict[str, dict[str, str]] = {}
    sections = re.split(r"^(#{2,3} .*)$", (DOCS / page).read_text(), flags=re.M)
    for heading, body in zip(sections[1::2], sections[2::2]):
        titled = [n for n in re.findall(r"`([^`]+)`", heading.split(" — ")[0]) if n in names]
        if not titled or "| parameter | default | meaning |" not in body:
            continue
        table = body.split("| parameter | default | meaning |", 1)[1].split("\n\n", 1)[0]
        rows = dict(_ROW.findall(table))
        for name in titled:
            out[name] = rows
    return out


def _same_default(doc_text: str, code_default) -> bool:
    value = eval(doc_text, {"__builtins__": {}})  # literals and 2**26
    if isinstance(code_default, kc.StrategySpec) or (isinstance(value, dict) and "name" in value):
        return kc.StrategySpec.coerce(value, "doc") == kc.StrategySpec.coerce(code_default, "code")
    if isinstance(value, list):
        value = tuple(value)
    return value == code_default and type(value) is type(code_default)


@pytest.mark.parametrize("kind", sorted(PARAM_PAGES))
def test_parameter_tables_match_the_code(kind):
    """Every parameter of every built-in strategy is documented with its real default."""
    registry = kc.registry.REGISTRIES[kind]
    names = {n for n in registry.list() if n != "windowed-average" and not n.startswith("test-")}
    documented = documented_parameters(PARAM_PAGES[kind], names)
    for name in sorted(names):
        factory = registry.get(name)
        if dataclasses.is_dataclass(factory):
            defaults = {f.name: f.default for f in dataclasses.fields(factory) if f.init}
        else:  # a plain class: its keyword parameters
            defaults = {p.name: p.default for p in inspect.signature(factory).parameters.values()
                        if p.default is not inspect.Parameter.empty}
        if not defaults:
            continue
        assert name in documented, f"{kind} {name!r} has no parameter table in docs/{PARAM_PAGES[kind]}"
        rows = documented[name]
        assert set(rows) == set(defaults), (name, sorted(rows), sorted(defaults))
        for param, text in rows.items():
            default = defaults[param]
            assert _same_default(text, default), f"{kind} {name}.{param}: docs say {text}, code {default!r}"
