"""GSC (SemantiCache's Greedy Seed-based Clustering) against a plain Python loop."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given
from hypothesis import strategies as st

from conftest import CORE_SETTINGS, min_gap_to_tau, random_keys, reference_gsc
from kvcompress.strategies.gsc import TAU_NO_MERGE, GreedySeedClustering
from kvcompress.types import KVState


def _random_case(seed: int, B: int, H: int, N: int, D: int, num_chunks: int, p_out: float, p_invalid: float):
    gen = torch.Generator().manual_seed(seed)
    keys = random_keys(gen, B, H, N, D)
    values = torch.randn(B, H, N, D, generator=gen)
    # arbitrary chunk ids: -1 (not clustered), chunks interleaved and non-contiguous
    chunk = torch.randint(0, num_chunks, (B, H, N), generator=gen)
    out = torch.rand(B, H, N, generator=gen) < p_out
    invalid = torch.rand(B, H, N, generator=gen) < p_invalid
    chunk = torch.where(out | invalid, -1, chunk)
    log_sizes = torch.zeros(B, H, N).masked_fill(invalid, float("-inf"))
    positions = torch.arange(N).expand(B, H, N).masked_fill(invalid, -1)
    state = KVState(keys=keys, values=values, log_sizes=log_sizes, positions=positions, num_tokens=N)
    return state, chunk


case_args = dict(
    seed=st.integers(0, 2**31 - 1),
    B=st.integers(1, 2),
    H=st.integers(1, 3),
    N=st.integers(1, 40),
    D=st.integers(1, 8),
    num_chunks=st.integers(1, 4),
    p_out=st.sampled_from([0.0, 0.2]),
    p_invalid=st.sampled_from([0.0, 0.1]),
)


@CORE_SETTINGS
@given(tau=st.floats(-1.0, 1.0), dense=st.booleans(), **case_args)
def test_gsc_fixed_tau_equals_reference_loop(tau, dense, seed, B, H, N, D, num_chunks, p_out, p_invalid):
    state, chunk = _random_case(seed, B, H, N, D, num_chunks, p_out, p_invalid)
    assume(min_gap_to_tau(state.keys, chunk, tau) > 1e-4)
    gsc = GreedySeedClustering(tau=tau, dense_limit=(1 << 26) if dense else 1)
    target = torch.full((B, H), N, dtype=torch.long)
    plan = gsc(state, chunk, target, 0)
    expected = reference_gsc(state.keys, chunk, state.valid, tau)
    assert torch.equal(plan.parent, expected)
    assert torch.allclose(plan.tau, torch.full((B, H), tau))


@CORE_SETTINGS
@given(keep=st.floats(0.05, 1.0), dense=st.booleans(), **case_args)
def test_gsc_searched_tau_meets_target_and_is_gsc_at_that_tau(keep, dense, seed, B, H, N, D, num_chunks, p_out,
                                                              p_invalid):
    state, chunk = _random_case(seed, B, H, N, D, num_chunks, p_out, p_invalid)
    valid = state.valid
    target = torch.floor(valid.sum(-1).double() * keep).long().clamp(min=1)  # [B, H]
    gsc = GreedySeedClustering(dense_limit=(1 << 26) if dense else 1)
    plan = gsc(state, chunk, target, 0)
    slot = torch.arange(N)
    kept = ((plan.parent == slot) & valid).sum(-1)  # [B, H] clusters after the plan
    # the fewest reachable slots: every chunk collapses into one, the rest stays
    outside = (valid & (chunk < 0)).sum(-1)
    chunks = torch.tensor([[len({int(c) for c in chunk[b, h].tolist() if c >= 0}) for h in range(H)]
                           for b in range(B)], dtype=torch.long).view(B, H)
    floor = outside + chunks
    feasible = floor <= target
    assert bool((kept[feasible] <= target[feasible]).all())
    assert torch.equal(kept[~feasible], floor[~feasible])  # infeasible heads: merge-all
    # rows that fit without merging are left alone
    fits = valid.sum(-1) <= target
    assert bool((plan.tau[fits] == TAU_NO_MERGE).all())
    # the plan is exactly GSC at the chosen per-head tau
    for b in range(B):
        for h in range(H):
            t = float(plan.tau[b, h])
            if t == TAU_NO_MERGE:
                assert bool((plan.parent[b, h][valid[b, h]] == slot[valid[b, h]]).all())
                continue
            assume(min_gap_to_tau(state.keys[b:b + 1, h:h + 1], chunk[b:b + 1, h:h + 1], t) > 1e-5)
            ref = reference_gsc(state.keys[b:b + 1, h:h + 1], chunk[b:b + 1, h:h + 1], valid[b:b + 1, h:h + 1], t)
            assert torch.equal(plan.parent[b, h], ref[0, 0])


def test_gsc_search_prefers_the_highest_feasible_tau():
    # two well separated directions per chunk: a budget of 2 slots needs only a mild threshold,
    # merging all (tau = -1) would also fit but is not what the search must return
    a, b = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    keys = torch.stack([a, a * 2, b, b * 3, a * 0.5, b])[None, None]  # [1, 1, 6, 2]
    state = KVState.from_raw(keys, torch.randn_like(keys))
    chunk = torch.zeros(1, 1, 6, dtype=torch.long)
    plan = GreedySeedClustering()(state, chunk, torch.tensor([[2]]), 0)
    assert plan.parent[0, 0].tolist() == [0, 0, 2, 2, 0, 2]
    assert 0.0 <= float(plan.tau[0, 0]) < 1.0


def test_gsc_merges_into_seed_not_chain():
    # k1 is similar to k0 and k2 is similar to k1 but not to k0: GSC compares with the SEED, so
    # k2 must stay out of k0's cluster (a chaining implementation would pull it in)
    keys = torch.tensor([[1.0, 0.0], [0.8, 0.6], [0.28, 0.96]])[None, None]
    state = KVState.from_raw(keys, keys.clone())
    chunk = torch.zeros(1, 1, 3, dtype=torch.long)
    plan = GreedySeedClustering(tau=0.7)(state, chunk, torch.tensor([[3]]), 0)
    assert plan.parent[0, 0].tolist() == [0, 0, 2]


@pytest.mark.parametrize("dense", [True, False])
def test_gsc_tau_one_merges_nothing_even_identical_keys(dense):
    # identical keys have cosine 1 up to rounding, often slightly above 1 in float32; "cos > 1"
    # must never hold
    k = torch.randn(1, 2, 64, 8, generator=torch.Generator().manual_seed(0))
    keys = k.repeat_interleave(2, dim=2)  # [1, 2, 128, 8]: every key twice in a row
    kn = F.normalize(keys, dim=-1)
    assert bool(((kn[..., ::2, :] * kn[..., 1::2, :]).sum(-1) > 1.0).any())  # the rounding is real
    state = KVState.from_raw(keys, torch.randn_like(keys))
    chunk = torch.zeros(1, 2, 128, dtype=torch.long)
    gsc = GreedySeedClustering(tau=1.0, dense_limit=(1 << 26) if dense else 1)
    plan = gsc(state, chunk, torch.tensor([[128, 128]]), 0)
    assert torch.equal(plan.parent, torch.arange(128).expand(1, 2, 128))
    # just below 1 every duplicate joins its twin
    plan = GreedySeedClustering(tau=0.9999)(state, chunk, torch.tensor([[128, 128]]), 0)
    assert torch.equal(plan.parent[0, 0, 1::2], torch.arange(0, 128, 2))


@pytest.mark.parametrize("dense", [True, False])
@pytest.mark.parametrize("tau", [-0.2, 0.3, 0.75])
def test_gsc_long_chunks_need_several_bitset_words(dense, tau):
    # chunks longer than 64 members: multi-word bitsets (and the unpaired threshold table)
    state, chunk = _random_case(7, 1, 2, 150, 6, 2, 0.1, 0.05)
    chunk = torch.where(chunk >= 0, 0, -1)  # one chunk of ~125 members per head
    chunk[0, 1, 100:] = torch.where(chunk[0, 1, 100:] >= 0, 1, -1)
    assume_gap = min_gap_to_tau(state.keys, chunk, tau)
    assert assume_gap > 1e-5
    gsc = GreedySeedClustering(tau=tau, dense_limit=(1 << 26) if dense else 1)
    plan = gsc(state, chunk, torch.full((1, 2), 150), 0)
    assert torch.equal(plan.parent, reference_gsc(state.keys, chunk, state.valid, tau))


def test_gsc_search_on_long_chunks():
    state, chunk = _random_case(8, 1, 2, 150, 6, 1, 0.1, 0.0)
    target = torch.tensor([[60, 30]])
    plan = GreedySeedClustering()(state, chunk, target, 0)
    slot = torch.arange(150)
    assert bool((((plan.parent == slot) & state.valid).sum(-1) <= target).all())
    for h in range(2):
        t = float(plan.tau[0, h])
        assert min_gap_to_tau(state.keys[:, h:h + 1], chunk[:, h:h + 1], t) > 1e-6
        ref = reference_gsc(state.keys[:, h:h + 1], chunk[:, h:h + 1], state.valid[:, h:h + 1], t)
        assert torch.equal(plan.parent[0, h], ref[0, 0])
