"""The evaluation runs the fitted presets: the recorder records their reference queries, a copy
holds what a real prefill holds, and fidelity / agreement / the importance-guided variants run."""

from __future__ import annotations

import math

import pytest
import torch

from kvcompress.config import StrategySpec
from kvcompress.eval.agreement import agreement_windows, run_agreement
from kvcompress.eval.caches import Recorder, compressed_copy, recording_needs
from kvcompress.eval.data import Haystack
from kvcompress.eval.fidelity import fidelity_windows, run_fidelity
from kvcompress.eval.greedy import greedy
from kvcompress.eval.methods import Method, parse_methods
from kvcompress.eval.reconstruction import copy_for
from kvcompress.eval.results import CellStore
from kvcompress.eval.runner import Grid

from test_eval_helpers import TEXT, model, one_thread, tiny_model, tiny_tokenizer, tok  # noqa: F401  (fixtures)

SMALL = {"recent": 8, "sinks": 2}



@pytest.fixture(scope="module")
def ids(tok):
    return tok(TEXT, add_special_tokens=False, return_tensors="pt")["input_ids"][:, :120]


def _config(preset: str, budget: float = 0.4):
    return Method.parse(preset).config(budget).replace(**SMALL)


def test_recorder_for_configs_records_the_reference_queries(model, tok, ids):
    prefill = _config("centroidkv").replace(merger=StrategySpec("fitted", {"queries": "prefill", "reference_queries": 16}))
    cfgs = [_config("centroidkv-fitted"), _config("snapkv"), prefill]
    needs = recording_needs(cfgs)
    assert needs.reference_queries == 16 and needs.query_window == 32  # centroidkv-fitted: the last 32
    rec = Recorder.for_configs(model, tok, cfgs, backend="sdpa")
    rec.feed(ids)
    snap = rec.snapshot()
    rec.close()
    for st in snap.states:
        assert st.extras["reference_queries"].shape[2] == 16
        assert st.extras["queries"].shape[2] == 32
    # each copy sees its own window: snapkv's 32 queries, not the grid's 64
    copy = compressed_copy(model, snap, cfgs[1])
    assert all(layer.queries.shape[2] == 32 for layer in copy.cache.layers)
    copy.cache.close()


@pytest.mark.parametrize("preset", ["centroidkv-fitted", "semanticache-fitted", "centroidkv-safe-fitted"])
def test_fitted_copy_equals_compressing_in_the_prefill(model, tok, ids, preset):
    """A copy compressed from the recorded prefill holds exactly what a real prefill's cache
    holds (the same strided reference queries reached the merger), and decodes the same."""
    from kvcompress.hf import CompressedCache
    from kvcompress.hf.generate import cache_kwarg

    cfg = _config(preset)
    direct = CompressedCache.for_model(model, tok, cfg, backend="sdpa")
    with torch.inference_mode():
        model.base_model(input_ids=ids, use_cache=True, **{cache_kwarg(model.base_model): direct})
    rec = Recorder.for_configs(model, tok, [cfg], backend="sdpa")
    rec.feed(ids)
    snap = rec.snapshot()
    rec.close()
    copy = compressed_copy(model, snap, cfg)
    mean = compressed_copy(model, snap, cfg.replace(merger=StrategySpec("mean")))
    moved = False
    for a, b, m in zip(direct.layers, copy.cache.layers, mean.cache.layers):
        assert a.n == b.n and a.num_tokens == b.num_tokens
        torch.testing.assert_close(a.keys, b.keys, rtol=0, atol=0)
        torch.testing.assert_close(a.values, b.values, rtol=0, atol=0)
        assert torch.equal(a.log_sizes, b.log_sizes) and torch.equal(a.positions, b.positions)
        moved = moved or (b.n == m.n and not torch.equal(b.log_sizes, m.log_sizes))
    assert moved  # the fit changed some merged slot's bias: it is not the mean merger
    assert copy.keep_max <= 0.4 + 1e-6
    nxt = ids[:, -1:]
    assert greedy(model, direct, nxt, 4)[0] == greedy(model, copy.cache, nxt, 4)[0]
    for c in (direct, copy.cache, mean.cache):
        c.close()


def test_a_recorder_without_reference_queries_is_a_value_error_naming_them(model, tok, ids):
    rec = Recorder(model, tok, backend="sdpa")  # records no queries at all
    rec.feed(ids)
    snap = rec.snapshot()
    rec.close()
    with pytest.raises(ValueError, match="query_window >= 32"):
        compressed_copy(model, snap, _config("centroidkv-fitted"))
    prefill = _config("centroidkv").replace(merger=StrategySpec("fitted", {"queries": "prefill"}))
    with pytest.raises(ValueError, match="reference_queries == 32.*Recorder.for_configs"):
        compressed_copy(model, snap, prefill)


def test_fidelity_runs_the_fitted_presets(model, tok, tmp_path):
    windows = fidelity_windows(tok, Haystack(TEXT, "toy"), prefix=80, continuation=20, samples=1)
    grid = Grid(parse_methods("full,centroidkv,centroidkv-fitted,semanticache-fitted", None, SMALL), (0.5,))
    records = run_fidelity(model, tok, windows, grid, CellStore(tmp_path, {"task": "fidelity"}), prefix=80,
                           backend="sdpa", progress=False)
    by = {r["preset"]: r for r in records}
    assert set(by) == {"full", "centroidkv", "centroidkv-fitted", "semanticache-fitted"}
    assert by["full"]["kl"] < 1e-6
    for name in ("centroidkv-fitted", "semanticache-fitted"):
        assert math.isfinite(by[name]["kl"]) and by[name]["kl"] > 1e-9 and by[name]["keep_max"] <= 0.5 + 1e-6
    assert by["centroidkv-fitted"]["kl"] != by["centroidkv"]["kl"]


def test_agreement_runs_the_fitted_presets(model, tok, tmp_path):
    windows = agreement_windows(tok, Haystack(TEXT, "toy"), length=90, samples=1)
    grid = Grid(parse_methods("centroidkv-fitted,semanticache-safe-fitted", None, SMALL), (0.5,))
    records = run_agreement(model, tok, windows, grid, CellStore(tmp_path, {"task": "agreement"}), new_tokens=6,
                            chat=False, backend="sdpa", progress=False)
    assert {r["preset"] for r in records} == {"centroidkv-fitted", "semanticache-safe-fitted"}
    for r in records:
        assert 0.0 <= r["lcs"] <= 1.0 and r["new_tokens"] >= 1 and r["keep_max"] <= 0.5 + 1e-6


@pytest.mark.parametrize("queries", ["window", "reconstruction", "window+reconstruction"])
def test_importance_guided_clusters_with_the_fitted_merger(model, tok, ids, queries):
    """kvzip-csm's clusters, slots fitted to the prefill queries, the reconstruction pass's
    queries or both: the copy gets the right queries and equals a real prefill with the pass."""
    from kvcompress.hf import CompressedCache
    from kvcompress.hf.generate import cache_kwarg

    cfg = _config("kvzip-csm").replace(merger=StrategySpec("fitted", {"queries": queries}))
    rec = Recorder.for_configs(model, tok, [cfg], backend="sdpa")
    rec.feed(ids)
    snap = rec.snapshot()
    rec.close()
    copy = copy_for(model, tok, snap, cfg)  # the repeat prompt the prefill hook uses (the chat template)
    mean = copy_for(model, tok, snap, cfg.replace(merger=StrategySpec("degree")))
    assert copy.keep_max <= 0.4 + 1e-6
    assert any(not torch.equal(a.values, b.values) for a, b in zip(copy.cache.layers, mean.cache.layers))
    direct = CompressedCache.for_model(model, tok, cfg, backend="sdpa")
    with torch.inference_mode():
        model(input_ids=ids, use_cache=True, **{cache_kwarg(model): direct})
    for a, b in zip(direct.layers, copy.cache.layers):
        torch.testing.assert_close(a.values, b.values, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.log_sizes, b.log_sizes, rtol=1e-5, atol=1e-5)
    for c in (direct, copy.cache, mean.cache):
        c.close()


def _decoded_cache(model, tok, ids, steps=30):
    """centroidkv-fitted over ``ids``, then ``steps`` greedy tokens with decode-time compression
    every 6 tokens past the budget; asserts finite logits on the way."""
    from kvcompress.hf import CompressedCache
    from kvcompress.hf.generate import cache_kwarg

    cfg = _config("centroidkv-fitted").replace(recompress_every=6)
    cache = CompressedCache.for_model(model, tok, cfg, backend="sdpa")
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True, **{cache_kwarg(model): cache})
        nxt = out.logits[:, -1:].argmax(-1)
        for _ in range(steps):
            out = model(input_ids=nxt, use_cache=True, **{cache_kwarg(model): cache})
            assert bool(torch.isfinite(out.logits).all())
            nxt = out.logits[:, -1:].argmax(-1)
    return cache


def test_decode_time_recompression_of_fitted_slots(model, tok, ids):
    """Decode-time compression refits already fitted slots to the latest window of decoding
    queries (the merger-level equivalence with a fresh fit of the expanded cache is
    tests/test_fitted.py::test_refitting_a_state_equals_fitting_its_expanded_cache): the budget
    holds and attention stays finite."""
    cache = _decoded_cache(model, tok, ids)
    assert cache.stats["decode_compressions"] > 0
    T = ids.shape[1] + 30
    for i in range(len(cache.layers)):
        st = cache.layer_state(i)
        assert st.num_tokens == T
        assert st.valid.sum(-1).max() <= 0.4 * T + 6 + 1
        assert st.extras["queries"].shape[2] == 32  # the window the fit uses, decoding queries included
        assert bool(torch.isfinite(st.log_sizes[st.valid]).all())
    cache.close()


def test_the_cache_keeps_token_counts_apart_from_the_fitted_bias(model, tok, ids):
    cache = _decoded_cache(model, tok, ids)
    T = ids.shape[1] + 30
    for i in range(len(cache.layers)):
        st = cache.layer_state(i)
        assert st.counts is not None and torch.equal(st.token_counts().sum(-1), torch.full((1, 2), float(T)))
    cache.close()
