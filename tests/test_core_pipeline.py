"""Pipeline invariants on random states: sizes, protection, chunk boundaries, budget, padding."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conftest import CORE_SETTINGS, make_state, members_of, token_chunk_ids
from kvcompress import BudgetError, Pipeline, PipelineConfig
from kvcompress.types import KVState

CHUNKERS = {
    "delimiter": {"name": "delimiter"},
    "fixed": {"name": "fixed", "params": {"size": 5}},
    "global": {"name": "global"},
}


def _config(chunker: str, budget, sinks: int, recent: int, **kw) -> PipelineConfig:
    keep_ratio, max_slots = (budget, None) if isinstance(budget, float) else (None, budget)
    return PipelineConfig(keep_ratio=keep_ratio, max_slots=max_slots, sinks=sinks, recent=recent,
                          chunker=CHUNKERS[chunker], clusterer={"name": "gsc"}, merger={"name": "mean"},
                          on_infeasible="best_effort", **kw)


def _token_groups(state: KVState, chunker: str) -> torch.Tensor:
    """[B, T] chunk of every token as the chunker must see it (delimiters: own group -1)."""
    start = state.start()
    if chunker == "delimiter":
        groups, is_delim = token_chunk_ids(state.token_ids, start)
        return torch.where(is_delim, -1, groups)
    T = state.num_tokens
    rel = torch.arange(T)[None, :] - start[:, None]
    if chunker == "fixed":
        return torch.div(rel, 5, rounding_mode="floor")
    return torch.zeros_like(rel)


def _protected_tokens(original: KVState, cfg: PipelineConfig) -> torch.Tensor:
    """[B, H, T] bool: sinks (from the first real token), the recent window, user-protected."""
    B, H, T = original.batch_size, original.num_heads, original.num_tokens
    start = original.start()
    t = torch.arange(T)
    real = t[None, :] >= start[:, None]  # [B, T]
    prot = real & (t[None, :] < start[:, None] + cfg.sinks)
    if cfg.recent:
        prot |= real & (t[None, :] >= T - cfg.recent)
    prot = prot[:, None, :].expand(B, H, T).clone()
    if original.protected is not None:
        prot |= original.protected & original.valid
    return prot


def _floor_slots(original: KVState, cfg: PipelineConfig, chunker: str) -> torch.Tensor:
    """[B, H] fewest slots reachable: protected tokens, delimiters, one slot per non-empty chunk."""
    groups = _token_groups(original, chunker)
    prot = _protected_tokens(original, cfg)
    start = original.start()
    B, H, T = prot.shape
    out = torch.zeros(B, H, dtype=torch.long)
    for b in range(B):
        for h in range(H):
            fixed, chunks = 0, set()
            for t in range(int(start[b]), T):
                if prot[b, h, t] or int(groups[b, t]) < 0:
                    fixed += 1
                else:
                    chunks.add(int(groups[b, t]))
            out[b, h] = fixed + len(chunks)
    return out


def check_invariants(original: KVState, out: KVState, cfg: PipelineConfig, chunker: str) -> None:
    """Everything a compressed state must satisfy, checked token by token through extras['member']."""
    B, H, T = original.batch_size, original.num_heads, original.num_tokens
    start = original.start()
    member = members_of(out)  # [B, H, M, T]
    valid = out.valid
    real = torch.arange(T)[None, :] >= start[:, None]  # [B, T]
    # every real token is in exactly one valid slot; padding tokens in none
    per_token = (member * valid[..., None]).sum(2)  # [B, H, T]
    assert torch.equal(per_token, real[:, None, :].expand(B, H, T).float())
    # padding slots hold nothing; sizes are the member counts and add up to the real tokens
    assert not bool(member[~valid].any())
    count = member.sum(-1)  # [B, H, M]
    assert torch.allclose(out.sizes(), count, rtol=1e-5)
    assert torch.allclose(out.sizes().sum(-1), (T - start).float()[:, None].expand(B, H), rtol=1e-5)
    # a slot's position is its earliest member (GSC seeds come first), never padding
    t_idx = torch.arange(T).float()
    first = torch.where(member > 0, t_idx, float("inf")).amin(-1)  # [B, H, M]
    assert torch.equal(out.positions[valid].float(), first[valid])
    assert bool((out.positions[valid] >= start[:, None, None].expand_as(valid)[valid]).all())
    assert bool((out.positions[~valid] == -1).all())
    # keys and values are the mean of the members' original keys and values (sizes start at 1)
    keys_mean = (member.double() @ original.keys.double()) / count.clamp(min=1)[..., None]
    vals_mean = (member.double() @ original.values.double()) / count.clamp(min=1)[..., None]
    assert torch.allclose(out.keys.double()[valid], keys_mean[valid], atol=1e-5)
    assert torch.allclose(out.values.double()[valid], vals_mean[valid], atol=1e-5)
    # clusters never cross chunk boundaries; delimiter anchors stay alone
    groups = _token_groups(original, chunker)  # [B, T]
    for b in range(B):
        for h in range(H):
            for m in range(out.num_slots):
                toks = member[b, h, m].nonzero().flatten().tolist()
                if len(toks) > 1:
                    g = {int(groups[b, t]) for t in toks}
                    assert len(g) == 1 and min(g) >= 0, (b, h, m, toks, g)
    # protected tokens are untouched, bit for bit
    prot = _protected_tokens(original, cfg)
    for b, h, t in prot.nonzero().tolist():
        m = int((out.positions[b, h] == t).nonzero()[0, 0])
        assert int(count[b, h, m]) == 1
        assert torch.equal(out.keys[b, h, m], original.keys[b, h, t])
        assert torch.equal(out.values[b, h, m], original.values[b, h, t])
        assert torch.equal(out.log_sizes[b, h, m], original.log_sizes[b, h, t])


budget_strategy = st.one_of(st.floats(0.05, 1.0), st.integers(1, 30))


@CORE_SETTINGS
@given(seed=st.integers(0, 2**31 - 1), B=st.integers(1, 2), H=st.integers(1, 2), N=st.integers(4, 28),
       chunker=st.sampled_from(sorted(CHUNKERS)), budget=budget_strategy, sinks=st.integers(0, 3),
       recent=st.integers(0, 4), padded=st.booleans(), user_protect=st.booleans(), rounds=st.integers(1, 2))
def test_compression_invariants(seed, B, H, N, chunker, budget, sinks, recent, padded, user_protect, rounds):
    gen = torch.Generator().manual_seed(seed + 1)
    pad = [int(torch.randint(0, N // 2, (), generator=gen)) for _ in range(B)] if padded else None
    protected = (torch.rand(B, H, N, generator=gen) < 0.1) if user_protect else None
    original = make_state(seed, B, H, N, pad=pad, protected=protected)
    cfg = _config(chunker, budget, sinks, recent)
    pipe = Pipeline(cfg)
    state = original
    floor = _floor_slots(original, cfg, chunker)
    for _ in range(rounds):
        state, report = pipe.compress(state)
        check_invariants(original, state, cfg, chunker)
        slots = state.valid.sum(-1)
        assert torch.equal(report.slots_per_head, slots)
        if isinstance(budget, float):
            real = (N - original.start()).double()
            expected_target = torch.floor(real * budget + 1e-9).long().clamp(min=1)[:, None].expand(B, H)
        else:
            expected_target = torch.full((B, H), budget)
        # rows the sinks and the recent window cover whole stay as they are, within budget
        short = (N - original.start()) <= sinks + recent
        expected_target = torch.where(short[:, None], torch.maximum(expected_target, slots), expected_target)
        assert torch.equal(report.target, expected_target)
        assert report.budget_met == bool((slots <= report.target).all())
        feasible = floor <= report.target
        # met wherever the floor allows it; elsewhere the smallest reachable cache
        assert bool((slots[feasible] <= report.target[feasible]).all())
        assert torch.equal(slots[~feasible], floor[~feasible])


@pytest.mark.parametrize("chunker", sorted(CHUNKERS))
@pytest.mark.parametrize("how", ["keep_ratio=1", "tau=1"])
def test_config_that_merges_nothing_is_an_exact_identity(chunker, how):
    state = make_state(3, B=2, H=2, N=20, with_membership=False)
    keys = state.keys.clone()
    keys[:, :, 10:] = keys[:, :, :10]  # identical keys: cosine 1 up to rounding must still not merge
    state = state.replace(keys=keys)
    if how == "keep_ratio=1":
        cfg = _config(chunker, 1.0, 2, 2)
    else:
        cfg = _config(chunker, 0.5, 0, 0).replace(**{"clusterer.tau": 1.0})
    out, report = Pipeline(cfg).compress(state)
    for name in ("keys", "values", "log_sizes", "positions"):
        assert torch.equal(getattr(out, name), getattr(state, name)), name
    assert report.budget_met == (how == "keep_ratio=1")


def test_identical_tokens_collapse_into_one_slot_through_the_pipeline():
    N = 9
    key, value = torch.randn(4), torch.randn(4)
    state = KVState.from_raw(key.expand(1, 3, N, 4).clone(), value.expand(1, 3, N, 4).clone())
    out, report = Pipeline(_config("global", 1, 0, 0)).compress(state)
    assert out.num_slots == 1 and report.budget_met
    assert torch.equal(out.keys[0, :, 0], state.keys[0, :, 0])
    assert torch.equal(out.values[0, :, 0], state.values[0, :, 0])
    assert torch.allclose(out.sizes(), torch.full((1, 3, 1), float(N)))
    assert math.isclose(float(out.log_sizes[0, 0, 0]), math.log(N), rel_tol=1e-6)


def test_left_padding_sinks_start_at_the_first_real_token():
    pad = [5, 0]
    state = make_state(11, B=2, H=2, N=16, pad=pad)
    cfg = _config("global", 1, 2, 0)  # keep only what protection forces + one merged slot
    out, _ = Pipeline(cfg).compress(state)
    check_invariants(state, out, cfg, "global")
    assert out.num_slots == 3  # padding is dropped, not just masked
    for b, p in enumerate(pad):
        for h in range(2):
            kept = out.positions[b, h][out.valid[b, h]].tolist()
            assert kept[:2] == [p, p + 1]  # the sinks
            assert len(kept) == 3 and kept[2] == p + 2  # everything else merged into one slot
            assert float(out.sizes()[b, h].sum()) == pytest.approx(16 - p)


def test_budget_error_names_keep_ratio_and_leaves_state_alone():
    state = make_state(5, B=1, H=2, N=20)
    before = state.keys.clone()
    with pytest.raises(BudgetError, match="keep_ratio=0.05") as info:
        Pipeline(_config("delimiter", 0.05, 4, 4).replace(on_infeasible="error")).compress(state)
    assert isinstance(info.value, ValueError)
    assert torch.equal(state.keys, before)


def test_best_effort_returns_the_smallest_reachable_cache():
    state = make_state(5, B=1, H=2, N=20)
    cfg = _config("delimiter", 0.05, 4, 4)
    out, report = Pipeline(cfg).compress(state)
    assert not report.budget_met
    assert torch.equal(out.valid.sum(-1), _floor_slots(state, cfg, "delimiter"))
    # merging everything inside each chunk (tau = -1) is what the floor means
    merge_all, _ = Pipeline(cfg.replace(**{"clusterer.tau": -1.0})).compress(state)
    assert torch.equal(merge_all.valid.sum(-1), out.valid.sum(-1))


def test_full_heads_keep_their_whole_cache():
    state = make_state(8, B=1, H=3, N=20)
    cfg = _config("global", 0.25, 0, 0, full_heads=((2, 1),))
    out, report = Pipeline(cfg).compress(state, layer_idx=2)
    assert int(out.valid[0, 1].sum()) == 20 and int(report.target[0, 1]) == 20
    assert torch.equal(out.keys[0, 1, :20], state.keys[0, 1])
    other, _ = Pipeline(cfg).compress(state, layer_idx=0)
    assert int(other.valid[0, 1].sum()) == 5
