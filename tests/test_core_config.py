"""Configs round-trip through dicts and JSON; presets exist and take overrides."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import CORE_SETTINGS
from kvcompress import Pipeline, PipelineConfig, StrategySpec, as_config, get_preset, list_presets

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6),
                         st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8))
params = st.dictionaries(st.text(min_size=1, max_size=8), st.one_of(json_scalars, st.lists(json_scalars, max_size=3)),
                         max_size=3)
specs = st.builds(lambda n, p: {"name": n, "params": p}, st.sampled_from(["delimiter", "fixed", "global", "gsc", "x"]),
                  params)


@st.composite
def configs(draw):
    budget = draw(st.one_of(st.floats(0.0, 1.0, exclude_min=True), st.integers(1, 10**6)))
    return PipelineConfig(
        name=draw(st.text(min_size=1, max_size=10)),
        keep_ratio=budget if isinstance(budget, float) else None,
        max_slots=budget if isinstance(budget, int) else None,
        sinks=draw(st.integers(0, 64)),
        recent=draw(st.integers(0, 512)),
        chunker=draw(specs),
        clusterer=draw(specs),
        merger=draw(specs),
        guards=draw(st.lists(specs, max_size=2)),
        max_rounds=draw(st.integers(1, 100)),
        on_infeasible=draw(st.sampled_from(["error", "best_effort"])),
        proportional_attention=draw(st.booleans()),
        recompress_every=draw(st.integers(1, 1000)),
        full_heads=draw(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 8)), max_size=3)),
        query_window=draw(st.integers(0, 64)),
        track_attention=draw(st.booleans()),
    )


@CORE_SETTINGS
@given(cfg=configs())
def test_config_round_trips_through_dict_and_json(cfg):
    assert PipelineConfig.from_dict(cfg.to_dict()) == cfg
    text = cfg.to_json()
    json.loads(text)  # plain JSON
    again = PipelineConfig.from_json(text)
    assert again == cfg and hash(again) == hash(cfg)


def test_config_round_trips_through_a_json_file(tmp_path):
    cfg = get_preset("semanticache", keep_ratio=0.25, **{"clusterer.tau": 0.8})
    path = tmp_path / "cfg.json"
    path.write_text(cfg.to_json())
    assert PipelineConfig.from_json(path) == cfg
    assert as_config(str(path)) == cfg


@pytest.mark.parametrize("name,chunker", [("semanticache", "delimiter"), ("semanticache-fixed64", "fixed"),
                                          ("semanticache-global", "global")])
def test_semanticache_presets_exist_and_take_overrides(name, chunker):
    assert name in list_presets("semanticache*")
    cfg = get_preset(name)
    assert cfg.name == name and cfg.chunker.name == chunker and cfg.clusterer.name == "gsc"
    assert cfg.merger.name == "mean"
    if name == "semanticache-fixed64":
        assert cfg.chunker.params["size"] == 64
    over = get_preset(name, keep_ratio=0.2, recent=8, **{"clusterer.tau": 0.9, "chunker.delimiters": [".", "!"]}
                      if chunker == "delimiter" else {"clusterer.tau": 0.9})
    assert over.keep_ratio == 0.2 and over.recent == 8 and over.clusterer.params["tau"] == 0.9
    assert over.chunker.name == chunker
    pipe = Pipeline(name, max_slots=10, **{"clusterer.tau": 0.5})
    assert pipe.config.max_slots == 10 and pipe.config.keep_ratio is None
    assert pipe.clusterer.tau == 0.5


def test_replace_switches_between_keep_ratio_and_max_slots():
    cfg = PipelineConfig(keep_ratio=0.3)
    assert cfg.replace(max_slots=7).keep_ratio is None
    assert cfg.replace(max_slots=7).replace(keep_ratio=0.4).max_slots is None
    assert PipelineConfig(max_slots=3).keep_ratio is None
    assert PipelineConfig().keep_ratio == 0.5


def test_strategy_spec_coercion():
    assert StrategySpec.coerce("gsc", "clusterer") == StrategySpec("gsc")
    assert StrategySpec.coerce({"name": "fixed", "params": {"size": 8}}, "chunker").params == {"size": 8}
    with pytest.raises(ValueError, match="chunker"):
        StrategySpec.coerce({"name": "fixed", "size": 8}, "chunker")


def test_unknown_preset_lists_known_ones_and_suggests():
    with pytest.raises(ValueError, match="semanticache") as info:
        get_preset("semanticach")
    assert "did you mean" in str(info.value)


def test_unknown_config_keys_and_overrides_are_rejected():
    with pytest.raises(ValueError, match="keep_ratoi"):
        PipelineConfig.from_dict({"keep_ratoi": 0.5})
    with pytest.raises(ValueError, match="keep_ratoi"):
        get_preset("semanticache", keep_ratoi=0.5)
    with pytest.raises(ValueError, match="scorer.x"):
        get_preset("semanticache", **{"scorer.x": 1})
