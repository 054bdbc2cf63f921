"""Bad input: unsupported models and attention setups, a cache reused with another model, dtype
and batch mismatches, budgets that cannot be met. Clear ValueErrors, and no half-changed cache."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("transformers")
from test_hf_utils import (  # noqa: E402
    MERGING, make_cache, prompt_ids, tiny_model,
    one_thread,  # noqa: F401  (autouse fixture)
)

from kvcompress import BudgetError, register_clusterer  # noqa: E402
from kvcompress.hf import CompressedCache  # noqa: E402
from kvcompress.registry import CLUSTERERS  # noqa: E402
from kvcompress.strategies.gsc import GreedySeedClustering  # noqa: E402


def _forward(model, ids, cache, **kw):
    with torch.no_grad():
        return model(input_ids=ids, cache=cache, **kw).logits


def _snapshot(cache):
    layers = []
    for layer in cache.layers:
        if not layer.is_initialized:
            layers.append(None)
            continue
        layers.append({name: getattr(layer, name).clone() for name in ("keys", "values", "log_sizes", "positions")})
    return {"T": cache.get_seq_length(), "ids": None if cache.token_ids is None else cache.token_ids.clone(),
            "layers": layers, "n": cache.slots_per_layer()}


def _assert_same(cache, snap):
    assert cache.get_seq_length() == snap["T"]
    assert cache.slots_per_layer() == snap["n"]
    if snap["ids"] is None:
        assert cache.token_ids is None or cache.token_ids.numel() == 0
    else:
        assert torch.equal(cache.token_ids, snap["ids"])
    for layer, saved in zip(cache.layers, snap["layers"]):
        if saved is None:
            assert not layer.is_initialized
            continue
        for name, t in saved.items():
            assert torch.equal(getattr(layer, name), t), name


def test_sliding_window_models_are_rejected():
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, sliding_window=16)
    with pytest.raises(ValueError, match="sliding"):
        CompressedCache.for_model(MistralForCausalLM(cfg), None, "semanticache")


def test_unknown_preset_and_backend_are_rejected_before_anything():
    model = tiny_model()
    with pytest.raises(ValueError, match="preset"):
        CompressedCache.for_model(model, None, "no-such-method")
    with pytest.raises(ValueError, match="backend"):
        CompressedCache.for_model(model, None, "semanticache", backend="cuda-magic")
    with pytest.raises(ValueError, match="keep_ratio"):
        CompressedCache.for_model(model, None, "semanticache", keep_ratio=1.5)


def test_stock_attention_implementation_is_rejected_without_changing_the_cache():
    model = tiny_model()
    cache = make_cache(model, **MERGING)
    model.set_attn_implementation("sdpa")
    with pytest.raises(ValueError, match="attn_implementation"):
        _forward(model, prompt_ids(0, 20), cache)
    assert cache.get_seq_length() == 0 and not cache.layers[0].is_initialized
    model.set_attn_implementation("kvcompress")
    _forward(model, prompt_ids(0, 20), cache)
    assert cache.get_seq_length() == 20


def test_cache_reused_with_a_model_of_another_geometry():
    model = tiny_model(seed=1)
    other = tiny_model(seed=2, num_key_value_heads=4)
    cache = make_cache(model, **MERGING)
    _forward(model, prompt_ids(1, 40), cache)
    snap = _snapshot(cache)
    with pytest.raises(ValueError, match="another model"):
        _forward(other, prompt_ids(2, 1), cache)
    _assert_same(cache, snap)
    with pytest.raises(ValueError, match="not yet bound"):
        cache.bind(other)
    cache.close()
    with pytest.raises(ValueError, match="created for"):
        cache.bind(other)


def test_bound_cache_reused_with_another_model_of_the_same_shape():
    model, twin = tiny_model(seed=3), tiny_model(seed=4)
    cache = make_cache(model, **MERGING)
    _forward(model, prompt_ids(3, 40), cache)
    snap = _snapshot(cache)
    with pytest.raises(ValueError, match="another model"):
        _forward(twin, prompt_ids(4, 1), cache)
    _assert_same(cache, snap)
    _forward(model, prompt_ids(4, 1), cache)  # still usable with its own model
    assert cache.get_seq_length() == 41


def test_dtype_change_is_rejected_before_any_change():
    model = tiny_model(seed=5)
    cache = make_cache(model, **MERGING)
    _forward(model, prompt_ids(5, 40), cache)
    snap = _snapshot(cache)
    model.to(torch.bfloat16)
    with pytest.raises(ValueError, match="dtype"):
        _forward(model, prompt_ids(6, 1), cache)
    _assert_same(cache, snap)


def test_batch_change_and_4d_masks_are_rejected():
    model = tiny_model(seed=6)
    cache = make_cache(model, **MERGING)
    _forward(model, prompt_ids(7, 40), cache)
    snap = _snapshot(cache)
    with pytest.raises(ValueError, match="batch"):
        _forward(model, prompt_ids(8, 1, batch=2), cache)
    _assert_same(cache, snap)
    bad_mask = torch.ones(1, 1, 1, 41, dtype=torch.bool)
    with pytest.raises(ValueError, match="attention_mask"):
        _forward(model, prompt_ids(9, 1), cache, attention_mask=bad_mask)
    _assert_same(cache, snap)


def test_budget_that_cannot_be_met_leaves_the_cache_empty():
    model = tiny_model(seed=7)
    cache = make_cache(model, "semanticache", keep_ratio=0.1, recent=32, on_infeasible="error",
                       fallback_chunker=None)  # 40 tokens: >= 36 protected, the paper chunking only
    with pytest.raises(BudgetError, match="infeasible"):
        _forward(model, prompt_ids(10, 40), cache)
    assert cache.get_seq_length() == 0 and all(not layer.is_initialized for layer in cache.layers)
    assert cache.token_ids is None
    with pytest.raises(BudgetError):  # the same input fails the same way: nothing was left behind
        _forward(model, prompt_ids(10, 40), cache)


def test_crop_and_set_inputs_misuse():
    model = tiny_model(seed=8)
    cache = make_cache(model, **MERGING)
    _forward(model, prompt_ids(11, 40), cache)
    with pytest.raises(ValueError, match="crop|tokens_to_remove"):
        cache.crop(-1)
    cache.crop(0)
    with pytest.raises(ValueError, match="set_inputs"):
        cache.set_inputs(prompt_ids(12, 1))


# ---------------------------------------------------------------------------- failures inside a forward
_CALLS = {"n": 0, "fail_at": None}


@dataclass(frozen=True)
class FlakyClustering(GreedySeedClustering):
    """GSC that raises on a chosen call (counted across layers), to fail mid-forward."""

    def __call__(self, state, chunk_ids, target, round_idx):
        _CALLS["n"] += 1
        if _CALLS["n"] == _CALLS["fail_at"]:
            raise RuntimeError("flaky clusterer failed")
        return super().__call__(state, chunk_ids, target, round_idx)


if "test-hf-flaky" not in CLUSTERERS.list():
    register_clusterer("test-hf-flaky")(FlakyClustering)


def test_failure_in_the_second_layer_of_a_prefill_undoes_the_first():
    model = tiny_model(seed=9)
    cache = make_cache(model, **MERGING, clusterer="test-hf-flaky")
    _CALLS.update(n=0, fail_at=2)  # layer 0 compresses, layer 1 fails
    with pytest.raises(RuntimeError, match="flaky"):
        _forward(model, prompt_ids(13, 40), cache)
    assert cache.get_seq_length() == 0 and not cache.layers[0].is_initialized
    _CALLS.update(n=0, fail_at=None)
    _forward(model, prompt_ids(13, 40), cache)
    assert cache.get_seq_length() == 40 and cache.layers[0].n < 40


def test_failure_in_a_decode_time_compression_restores_every_layer():
    model = tiny_model(seed=10)
    cache = make_cache(model, **dict(MERGING, recompress_every=1), clusterer="test-hf-flaky")
    _CALLS.update(n=0, fail_at=None)
    _forward(model, prompt_ids(14, 40), cache)
    snap = _snapshot(cache)
    _CALLS.update(n=0, fail_at=2)  # the follow-up recompresses layer 0, then layer 1 fails
    with pytest.raises(RuntimeError, match="flaky"):
        _forward(model, prompt_ids(15, 8), cache)
    _assert_same(cache, snap)
    _CALLS.update(n=0, fail_at=None)
    _forward(model, prompt_ids(15, 8), cache)
    assert cache.get_seq_length() == 48
