"""The size-weighted mean merger against a plain loop, and its exactness guarantees."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conftest import CORE_SETTINGS
from kvcompress.strategies.mergers import MeanMerger, apply_merge_plan
from kvcompress.types import KVState


def _random_plan(gen: torch.Generator, B: int, H: int, N: int, p_merge: float, p_drop: float) -> torch.Tensor:
    """parent [B, H, N]: each slot keeps itself, merges into an earlier representative, or drops."""
    parent = torch.full((B, H, N), -1, dtype=torch.long)
    for b in range(B):
        for h in range(H):
            reps = []
            for n in range(N):
                u = float(torch.rand((), generator=gen))
                if reps and u < p_merge:
                    parent[b, h, n] = reps[int(torch.randint(0, len(reps), (), generator=gen))]
                elif u < p_merge + p_drop:
                    parent[b, h, n] = -1
                else:
                    parent[b, h, n] = n
                    reps.append(n)
    return parent


def _reference_merge(state: KVState, parent: torch.Tensor, weighting: str):
    """Per (b, h): representatives in slot order, float64 weighted means, summed sizes."""
    B, H, N, D = state.keys.shape
    out = []
    for b in range(B):
        row = []
        for h in range(H):
            slots = []
            for r in range(N):
                if int(parent[b, h, r]) != r:
                    continue
                members = [n for n in range(N) if int(parent[b, h, n]) == r]
                sizes = torch.tensor([math.exp(float(state.log_sizes[b, h, n])) for n in members], dtype=torch.float64)
                w = sizes if weighting == "size" else torch.ones(len(members), dtype=torch.float64)
                k = (state.keys[b, h, members].double() * w[:, None]).sum(0) / w.sum()
                v = (state.values[b, h, members].double() * w[:, None]).sum(0) / w.sum()
                slots.append((k, v, float(sizes.sum()), int(state.positions[b, h, r]), len(members)))
            row.append(slots)
        out.append(row)
    return out


@CORE_SETTINGS
@given(seed=st.integers(0, 2**31 - 1), B=st.integers(1, 2), H=st.integers(1, 3), N=st.integers(1, 20),
       D=st.integers(1, 6), p_merge=st.sampled_from([0.0, 0.3, 0.7]), p_drop=st.sampled_from([0.0, 0.2]),
       weighting=st.sampled_from(["size", "uniform"]), rounds=st.integers(1, 2))
def test_merger_equals_reference_loop(seed, B, H, N, D, p_merge, p_drop, weighting, rounds):
    gen = torch.Generator().manual_seed(seed)
    state = KVState.from_raw(torch.randn(B, H, N, D, generator=gen), torch.randn(B, H, N, D, generator=gen))
    if rounds == 2:  # start from a state whose sizes are already > 1
        state = apply_merge_plan(state, _random_plan(gen, B, H, N, 0.5, 0.0))
    M0 = state.num_slots
    parent = _random_plan(gen, B, H, M0, p_merge, p_drop)
    parent = torch.where(state.valid, parent, -1)
    expected = _reference_merge(state, parent, weighting)
    merged = apply_merge_plan(state, parent, weighting)
    M = max(len(expected[b][h]) for b in range(B) for h in range(H))
    assert merged.num_slots == M
    for b in range(B):
        for h in range(H):
            slots = expected[b][h]
            for m, (k, v, size, pos, count) in enumerate(slots):
                assert torch.allclose(merged.keys[b, h, m].double(), k, atol=1e-5)
                assert torch.allclose(merged.values[b, h, m].double(), v, atol=1e-5)
                assert math.isclose(float(merged.log_sizes[b, h, m].exp()), size, rel_tol=1e-5)
                assert int(merged.positions[b, h, m]) == pos
                if count == 1:  # a singleton is bit for bit its representative
                    r = pos if rounds == 1 else int((state.positions[b, h] == pos).nonzero()[0, 0])
                    assert torch.equal(merged.keys[b, h, m], state.keys[b, h, r])
                    assert torch.equal(merged.values[b, h, m], state.values[b, h, r])
                    assert torch.equal(merged.log_sizes[b, h, m], state.log_sizes[b, h, r])
            for m in range(len(slots), M):  # padding of heads with fewer representatives
                assert merged.log_sizes[b, h, m] == float("-inf")
                assert int(merged.positions[b, h, m]) == -1
                assert not bool(merged.keys[b, h, m].any()) and not bool(merged.values[b, h, m].any())


def test_identical_tokens_merge_into_one_slot_of_size_n_bit_for_bit():
    N = 7
    key, value = torch.randn(5), torch.randn(5)
    keys = key.expand(1, 2, N, 5).clone()
    values = value.expand(1, 2, N, 5).clone()
    state = KVState.from_raw(keys, values)
    parent = torch.zeros(1, 2, N, dtype=torch.long)
    merged = MeanMerger()(state, parent)
    assert merged.num_slots == 1
    assert torch.equal(merged.keys[0, :, 0], keys[0, :, 0])
    assert torch.equal(merged.values[0, :, 0], values[0, :, 0])
    assert torch.allclose(merged.sizes(), torch.full((1, 2, 1), float(N)))


def test_merger_sums_stats_over_members_carries_extras_and_keeps_protected_flags():
    state = KVState.from_raw(torch.randn(1, 1, 4, 3), torch.randn(1, 1, 4, 3),
                             protected=torch.tensor([[[True, False, False, False]]]))
    # "queries" shaped exactly like a per-slot tensor (Hq == H, W == N): carried, never summed
    queries = torch.randn(1, 1, 4, 3)
    state = state.replace(stats={"attn": torch.tensor([[[1.0, 2.0, 4.0, 8.0]]])},
                          extras={"queries": queries, "note": "kept as is"})
    merged = apply_merge_plan(state, torch.tensor([[[0, 1, 1, -1]]]))
    assert merged.stats["attn"].tolist() == [[[1.0, 6.0]]]
    assert merged.extras["note"] == "kept as is"
    assert merged.extras["queries"] is queries
    assert merged.protected.tolist() == [[[True, False]]]
    assert merged.positions.tolist() == [[[0, 1]]]
    assert merged.counts is None  # counts stay implicit (exp(log_sizes)) when they were
    assert merged.token_counts().tolist() == [[[1.0, 2.0]]]


@CORE_SETTINGS
@given(seed=st.integers(0, 2**31 - 1), N=st.integers(1, 16), p_merge=st.sampled_from([0.3, 0.7]),
       p_drop=st.sampled_from([0.0, 0.2]), weighting=st.sampled_from(["size", "uniform"]))
def test_explicit_counts_merge_bit_identical_to_implicit_ones(seed, N, p_merge, p_drop, weighting):
    """counts == exp(log_sizes) given explicitly: the same keys, values and biases bit for bit,
    and the counts add up over members (padding 0)."""
    gen = torch.Generator().manual_seed(seed)
    B, H, D = 2, 2, 4
    state = KVState.from_raw(torch.randn(B, H, N, D, generator=gen), torch.randn(B, H, N, D, generator=gen))
    state = apply_merge_plan(state, _random_plan(gen, B, H, N, 0.5, 0.0))  # sizes > 1
    explicit = state.replace(counts=state.log_sizes.exp())
    parent = torch.where(state.valid, _random_plan(gen, B, H, state.num_slots, p_merge, p_drop), -1)
    a = apply_merge_plan(state, parent, weighting)
    b = apply_merge_plan(explicit, parent, weighting)
    for name in ("keys", "values", "log_sizes", "positions"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    expected = torch.zeros(B, H, a.num_slots)
    for bb in range(B):
        for h in range(H):
            reps = [r for r in range(state.num_slots) if int(parent[bb, h, r]) == r]
            for m, r in enumerate(reps):
                members = (parent[bb, h] == r).nonzero().flatten()
                expected[bb, h, m] = explicit.counts[bb, h, members].sum()
    torch.testing.assert_close(b.counts, expected, rtol=1e-6, atol=0)
    assert torch.equal(b.token_counts(), b.counts.masked_fill(~b.valid, 0.0))
    b.validate()


def test_counts_weigh_the_mean_when_the_bias_is_fitted():
    """A fitted merger's finite bias is not a size: the mean weighs by counts."""
    keys = torch.tensor([[[[0.0], [3.0]]]])
    state = KVState.from_raw(keys, keys.clone())
    fitted = state.replace(log_sizes=torch.tensor([[[5.0, -2.0]]]), counts=torch.tensor([[[1.0, 2.0]]]))
    merged = apply_merge_plan(fitted, torch.tensor([[[0, 0]]]))
    assert merged.keys.flatten().tolist() == [2.0]  # (1 * 0 + 2 * 3) / 3
    assert merged.counts.tolist() == [[[3.0]]]
    assert math.isclose(float(merged.log_sizes), math.log(3.0), rel_tol=1e-6)


def test_validate_rejects_misshaped_counts_and_stats():
    state = KVState.from_raw(torch.randn(1, 2, 5, 3), torch.randn(1, 2, 5, 3))
    with pytest.raises(ValueError, match="counts"):
        state.replace(counts=torch.ones(1, 2, 4)).validate()
    with pytest.raises(ValueError, match="stats"):
        state.replace(stats={"attn_acc": torch.ones(1, 2, 4)}).validate()


def test_identity_plan_returns_the_same_state():
    state = KVState.from_raw(torch.randn(2, 2, 5, 3), torch.randn(2, 2, 5, 3))
    assert MeanMerger()(state, torch.arange(5).expand(2, 2, 5)) is state


def test_plan_into_a_non_representative_is_rejected():
    state = KVState.from_raw(torch.randn(1, 1, 3, 2), torch.randn(1, 1, 3, 2))
    with pytest.raises(ValueError, match="parent"):
        apply_merge_plan(state, torch.tensor([[[0, 0, 1]]]))  # 2 -> 1, but 1 merged into 0
