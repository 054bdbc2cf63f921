"""Eviction baselines (evict clusterer, StreamingLLM, H2O, SnapKV, key-norm, full) against loops."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompress import CLUSTERERS, BudgetError, KVState, Pipeline, PipelineConfig, StrategySpec, get_preset
from kvcompress.decode import append_tokens


def make_state(B=2, H=3, N=16, D=4, pad=(0, 3), seed=0, **extras) -> KVState:
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, N)
    for b, p in enumerate(pad[:B]):
        mask[b, :p] = 0
    state = KVState.from_raw(torch.randn(B, H, N, D, generator=g), torch.randn(B, H, N, D, generator=g),
                             attention_mask=mask)
    stats = {k: extras.pop(k) for k in ("attn_acc",) if k in extras}  # per-slot statistics
    return state.replace(extras=extras, stats=stats)


def ref_evict(state: KVState, protected: torch.Tensor, target: torch.Tensor, scores: torch.Tensor,
              recent_share: float) -> set[tuple[int, int, int]]:
    """Kept (b, h, n) by plain loops: protected stay, then recent share by position, then best scores."""
    kept = set()
    B, H, N = scores.shape
    for b in range(B):
        for h in range(H):
            valid = [n for n in range(N) if bool(state.valid[b, h, n])]
            free = [n for n in valid if not bool(protected[b, h, n])]
            kept |= {(b, h, n) for n in valid if bool(protected[b, h, n])}
            quota = max(0, int(target[b, h]) - (len(valid) - len(free)))
            n_recent = math.floor(quota * recent_share + 1e-9)
            recent = sorted(free, key=lambda n: -int(state.positions[b, h, n]))[:n_recent]
            rest = [n for n in free if n not in recent]
            best = sorted(rest, key=lambda n: (-float(scores[b, h, n]), n))[: quota - n_recent]
            kept |= {(b, h, n) for n in recent + best}
    return kept


def kept_set(state: KVState, out: KVState) -> set[tuple[int, int, int]]:
    """(b, h, original slot) of every slot left, identified by position (raw states: slot = position)."""
    got = set()
    for b, h, m in (out.valid).nonzero().tolist():
        got.add((b, h, int(out.positions[b, h, m])))
    return got


@pytest.mark.parametrize("scorer,share", [("knorm", 0.0), ("random", 0.0), ("knorm", 0.5), ("recency", 0.25)])
@pytest.mark.parametrize("ratio", [0.25, 0.5, 0.8])
def test_evict_matches_loops(scorer, share, ratio):
    state = make_state()
    cfg = PipelineConfig(keep_ratio=ratio, sinks=2, recent=3, on_infeasible="best_effort", clusterer=StrategySpec(
        "evict", {"scorer": scorer, "recent_share": share}), merger="mean")
    pipe = Pipeline(cfg)
    out, report = pipe.compress(state)
    protected = pipe.protection(state)
    scores = pipe.clusterer._scorer(state)
    assert kept_set(state, out) == ref_evict(state, protected, pipe.target_slots(state), scores, share)
    assert torch.equal(report.slots_per_head, torch.maximum(report.target, protected.sum(-1)))
    # survivors are untouched copies of the originals
    for b, h, m in out.valid.nonzero().tolist():
        n = int(out.positions[b, h, m])
        assert torch.equal(out.keys[b, h, m], state.keys[b, h, n])
        assert torch.equal(out.values[b, h, m], state.values[b, h, n])
        assert float(out.log_sizes[b, h, m]) == 0.0


@pytest.mark.parametrize("preset", ["h2o", "snapkv"])
def test_attention_presets_match_loops(preset):
    state = make_state(queries=torch.randn(2, 6, 4, 4), attn_acc=torch.zeros(2, 3, 16))
    pipe = Pipeline(preset, keep_ratio=0.5, query_window=4, recent=4 if preset == "snapkv" else 0)
    out, _ = pipe.compress(state)
    scores = pipe.clusterer._scorer(state)
    share = pipe.config.clusterer.params["recent_share"]
    assert kept_set(state, out) == ref_evict(state, pipe.protection(state), pipe.target_slots(state), scores, share)


@pytest.mark.parametrize("sinks,recent", [(4, 4), (2, 7), (0, 5), (3, 0)])
def test_streamingllm_keeps_exactly_sinks_and_recent(sinks, recent):
    state = make_state(N=20, pad=(0, 5))
    expect = set()
    for b in range(2):
        start = int(state.start()[b])
        for h in range(3):
            expect |= {(b, h, start + i) for i in range(sinks)} | {(b, h, 20 - 1 - i) for i in range(recent)}
    # budget == sinks + recent, the window protected explicitly ...
    out, _ = Pipeline("streamingllm", max_slots=sinks + recent, sinks=sinks, recent=recent).compress(state)
    assert kept_set(state, out) == expect
    # ... or implied by the budget (recent window = budget - sinks), as the preset does
    out, _ = Pipeline("streamingllm", max_slots=sinks + recent, sinks=sinks, recent=0).compress(state)
    assert kept_set(state, out) == expect


def test_streamingllm_window_is_budget_minus_sinks():
    state = make_state(B=1, N=30, pad=(0,))
    out, _ = Pipeline("streamingllm", keep_ratio=0.5).compress(state)  # 15 slots: 4 sinks + 11 recent
    assert out.positions[0, 0].tolist() == list(range(4)) + list(range(19, 30))


@settings(max_examples=30, deadline=None)
@given(
    B=st.integers(1, 3), H=st.integers(1, 3), N=st.integers(1, 24),
    ratio=st.floats(0.05, 1.0), sinks=st.integers(0, 4), recent=st.integers(0, 4),
    scorer=st.sampled_from(["knorm", "random", "recency"]), share=st.sampled_from([0.0, 0.5, 1.0]),
    pad=st.integers(0, 5), seed=st.integers(0, 10),
)
def test_budget_met_per_head(B, H, N, ratio, sinks, recent, scorer, share, pad, seed):
    pads = tuple(min(pad * b, N - 1) for b in range(B))
    state = make_state(B=B, H=H, N=N, pad=pads, seed=seed)
    pipe = Pipeline(PipelineConfig(keep_ratio=ratio, sinks=sinks, recent=recent, on_infeasible="best_effort",
                                   clusterer=StrategySpec("evict", {"scorer": scorer, "recent_share": share})))
    out, report = pipe.compress(state)
    protected = pipe.protection(state).sum(-1)
    target = pipe.target_slots(state)
    valid = state.valid.sum(-1)
    expect = torch.minimum(torch.maximum(target, protected), valid)  # exactly the target when feasible
    assert torch.equal(out.valid.sum(-1), expect)
    short = state.real_tokens() <= sinks + recent  # rows the protection covers whole count as met
    assert report.budget_met == bool(((expect <= target) | short[:, None]).all())
    assert torch.equal(out.sizes().sum(-1), out.valid.sum(-1).float())  # eviction never merges


def test_infeasible_budget_raises():
    with pytest.raises(BudgetError):
        Pipeline("streamingllm", max_slots=3, sinks=4, on_infeasible="error").compress(make_state())


def test_full_is_an_exact_identity():
    state = make_state(pad=(0, 5), attn_acc=torch.rand(2, 3, 16))
    out, report = Pipeline("full").compress(state)
    assert out is state and report.budget_met and torch.equal(report.slots_per_head, state.valid.sum(-1))
    grown = append_tokens(state, torch.randn(2, 3, 5, 4), torch.randn(2, 3, 5, 4))
    assert Pipeline("full").compress(grown)[0] is grown


def test_identity_merger_refuses_a_real_plan():
    with pytest.raises(ValueError, match="keeps every valid slot"):
        Pipeline(PipelineConfig(keep_ratio=0.5, clusterer="evict", merger="identity")).compress(make_state())


@pytest.mark.parametrize("preset", ["streamingllm", "h2o", "snapkv", "knorm"])
def test_recompress_after_decoding(preset):
    """A compressed state with raw tokens appended compresses again to the budget, sinks kept."""
    cfg = get_preset(preset, keep_ratio=0.5, query_window=4, **({"recent": 4} if preset == "snapkv" else {}))
    state = make_state(N=20, queries=torch.randn(2, 6, 4, 4), attn_acc=torch.zeros(2, 3, 20))
    pipe = Pipeline(cfg)
    out, _ = pipe.compress(state)
    extras = {**out.extras, "queries": torch.randn(2, 6, 4, 4)}
    stats = dict(out.stats)
    if "attn_acc" in stats:
        stats["attn_acc"] = torch.rand(out.log_sizes.shape).masked_fill(~out.valid, 0)
    grown = append_tokens(out.replace(extras=extras, stats=stats), torch.randn(2, 3, 6, 4), torch.randn(2, 3, 6, 4))
    again, report = pipe.compress(grown)
    assert report.budget_met and torch.equal(again.valid.sum(-1), pipe.target_slots(grown))
    assert (again.positions[again.valid] < 26).all()
    for b in range(2):  # sinks of each row survive both compressions
        start = int(state.start()[b])
        for h in range(3):
            pos = set(again.positions[b, h][again.valid[b, h]].tolist())
            assert set(range(start, start + cfg.sinks)) <= pos


def test_h2o_decode_uses_accumulated_attention():
    """After decoding, heavy hitters follow attn_acc, not the prompt window."""
    state = make_state(B=1, H=1, N=12, pad=(0,), queries=torch.randn(1, 2, 4, 4), attn_acc=torch.zeros(1, 1, 12))
    pipe = Pipeline("h2o", max_slots=6, query_window=4)
    acc = torch.arange(12, 0, -1).float()[None, None]  # the earliest slots are the heaviest
    out, _ = pipe.compress(state.replace(stats={**state.stats, "attn_acc": acc}))
    # 3 recent (positions 9..11) + 3 heaviest (positions 0..2)
    assert out.positions[0, 0].tolist() == [0, 1, 2, 9, 10, 11]


@pytest.mark.parametrize("params", [{"recent_share": 1.5}, {"scorer": "nope"}, {"scorer": {"name": "snapkv", "params": {"kernel_size": 2}}}])
def test_evict_bad_parameters(params):
    with pytest.raises(ValueError):
        CLUSTERERS.create("evict", params)


@pytest.mark.parametrize("preset", ["streamingllm", "knorm", "cam", "d2o"])
def test_decode_floor_is_the_protected_slots_only(preset):
    """Eviction can drop every clusterable slot: the decode driver's floor adds no slot per chunk."""
    from kvcompress.decode import DecodeCompressor

    state = make_state(N=20)
    pipe = Pipeline(preset, keep_ratio=0.1)
    floor = DecodeCompressor(pipe).floor(state)
    assert torch.equal(floor, pipe.protection(state).sum(-1))
    assert DecodeCompressor(pipe).scope == "all"
