"""The baseline presets: registered, serialisable, self-sufficient, and running in the HF cache."""

from __future__ import annotations

import pytest
import torch

from kvcompress import KVState, Pipeline, PipelineConfig, get_preset, list_presets, list_strategies

BASELINES = ("full", "streamingllm", "h2o", "snapkv", "knorm", "cam", "cam-prop", "d2o", "d2o-prop")


def stats_state(cfg: PipelineConfig, B=2, H=2, Hq=4, N=100, D=8, seed=0) -> KVState:
    """A random prefill state with exactly the statistics the config asks the cache for."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, N)
    mask[1, :4] = 0
    state = KVState.from_raw(torch.randn(B, H, N, D, generator=g), torch.randn(B, H, N, D, generator=g),
                             attention_mask=mask)
    extras, stats = {}, {}
    if cfg.query_window:
        extras["queries"] = torch.randn(B, Hq, min(cfg.query_window, N), D, generator=g)
    if cfg.track_attention:
        stats["attn_acc"] = torch.rand(B, H, N, generator=g).masked_fill(~state.valid, 0)
    return state.replace(extras=extras, stats=stats)


def test_every_baseline_is_registered():
    assert set(BASELINES) <= set(list_presets())
    kinds = list_strategies()
    assert {"evict", "keep", "cam", "d2o"} <= set(kinds["clusterer"])
    assert {"identity", "cam", "d2o"} <= set(kinds["merger"])
    assert {"knorm", "recency", "random", "attention", "snapkv", "h2o"} <= set(kinds["scorer"])


@pytest.mark.parametrize("name", BASELINES)
def test_preset_round_trips_and_meets_its_budget(name):
    cfg = get_preset(name)
    assert PipelineConfig.from_json(cfg.to_json()) == cfg
    state = stats_state(cfg)
    out, report = Pipeline(cfg).compress(state)
    assert report.budget_met
    assert torch.equal(out.valid.sum(-1), Pipeline(cfg).target_slots(state))
    if name == "full":
        assert out is state


@pytest.mark.parametrize("name,needs", [("h2o", "track_attention"), ("snapkv", "query_window"),
                                        ("cam", "query_window"), ("d2o", "track_attention")])
def test_presets_name_the_statistics_they_miss(name, needs):
    state = stats_state(PipelineConfig())  # no statistics at all
    with pytest.raises(ValueError, match=needs):
        Pipeline(name).compress(state)


def test_presets_document_their_windows():
    assert get_preset("snapkv").query_window == 32 and get_preset("snapkv").recent == 32
    assert get_preset("snapkv").clusterer.params["scorer"]["params"] == {"kernel_size": 7, "pooling": "max"}
    assert get_preset("h2o").clusterer.params["recent_share"] == 0.5 and get_preset("h2o").track_attention
    assert get_preset("streamingllm").sinks == 4 and get_preset("streamingllm").recent == 0
    assert not get_preset("cam").proportional_attention and get_preset("cam-prop").proportional_attention


# ------------------------------------------------------------------ end to end, tiny random Llama
@pytest.fixture(scope="module")
def tiny_llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return transformers.LlamaForCausalLM(cfg).eval()


def _generate(model, preset, **overrides):
    from kvcompress.hf import CompressedCache

    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    cache = CompressedCache.for_model(model, None, preset, backend="sdpa", **overrides)
    try:
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, cache=cache, max_new_tokens=6,
                                 do_sample=False, pad_token_id=0)
    finally:
        cache.close()
    return out[:, 24:], cache


def test_full_preset_generates_like_an_uncompressed_cache(tiny_llama):
    ref, _ = _generate(tiny_llama, None)
    got, cache = _generate(tiny_llama, "full")
    assert torch.equal(got, ref)
    assert [layer.state().valid.sum(-1).max().item() for layer in cache.layers] == [29, 29]


# one preset per kind of statistic and merger (the others share their code paths)
@pytest.mark.parametrize("name", ["h2o", "snapkv", "cam-prop", "d2o"])
def test_preset_runs_in_the_transformers_cache(tiny_llama, name):
    overrides = dict(keep_ratio=0.5, recompress_every=2)
    if name == "snapkv":
        overrides.update(recent=8, query_window=8)
    _, cache = _generate(tiny_llama, name, **overrides)
    assert cache.stats["prefill_compressions"] == 2 and cache.stats["decode_compressions"] >= 2
    for layer in cache.layers:
        state = layer.state()
        target = cache.pipeline.target_slots(state)
        assert (state.valid.sum(-1) <= target + 2).all()
