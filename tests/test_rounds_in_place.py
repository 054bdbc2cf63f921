"""The pipeline's rounds in place (merged slots left as padding, one compaction after the last
round) against merging and compacting every round (the previous path, kept as the slow reference:
``Pipeline._rounds_in_place = False``), and ``merge_in_place`` + ``compact`` against
``apply_merge_plan`` on random plans.

Per representative the arithmetic is the same, term for term; only exp/log of the sizes may round
differently in the last bit (a vectorised and a scalar kernel, depending on where a value sits),
hence the float tolerance. Plans, positions, protection and integer stats must be equal."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kvcompress as kc
from conftest import BPE_VOCAB, CORE_SETTINGS, random_keys
from kvcompress.strategies.mergers import apply_merge_plan, compact, merge_in_place
from kvcompress.types import KVState


def _state(seed, B, H, N, D, pad, dtype=torch.float32, counts=False, protected=False):
    gen = torch.Generator().manual_seed(seed)
    keys = random_keys(gen, B, H, N, D).to(dtype)
    values = torch.randn(B, H, N, D, generator=gen).to(dtype)
    mask = torch.ones(B, N, dtype=torch.long)
    for b in range(B):
        mask[b, : min(pad * b, N - 1)] = 0  # row b left-padded by pad * b tokens
    prot = (torch.rand(B, H, N, generator=gen) < 0.05) if protected else None
    token_ids = torch.randint(0, len(BPE_VOCAB), (B, N), generator=gen)
    state = KVState.from_raw(keys, values, token_ids=token_ids, attention_mask=mask, protected=prot, vocab=BPE_VOCAB)
    stats = {"mark": (torch.rand(B, H, N, generator=gen) < 0.3).to(torch.uint8),
             "score": torch.rand(B, H, N, generator=gen)}
    extra = {"counts": state.token_counts().clone()} if counts else {}
    return state.replace(stats=stats, **extra)


def _same_state(a: KVState, b: KVState, exact: bool = False):
    assert a.keys.shape == b.keys.shape
    assert torch.equal(a.positions, b.positions)
    assert torch.equal(a.valid, b.valid)
    assert (a.protected is None) == (b.protected is None)
    if a.protected is not None:
        assert torch.equal(a.protected, b.protected)
    assert torch.equal(a.stats["mark"], b.stats["mark"])
    tol = dict(rtol=0, atol=0) if exact else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a.stats["score"], b.stats["score"], **tol)
    torch.testing.assert_close(a.keys.float(), b.keys.float(), **(tol if a.keys.dtype == torch.float32 else
                                                                   dict(rtol=1e-2, atol=1e-2)))
    torch.testing.assert_close(a.values.float(), b.values.float(), **(tol if a.keys.dtype == torch.float32 else
                                                                       dict(rtol=1e-2, atol=1e-2)))
    torch.testing.assert_close(a.log_sizes, b.log_sizes, **tol)
    assert (a.counts is None) == (b.counts is None)
    if a.counts is not None:
        torch.testing.assert_close(a.counts, b.counts, **tol)


def _random_plan(gen, state, p_rep, p_drop):
    """[B, H, N] long: random representatives among the valid slots, every other valid slot merged
    into a random representative of its head (or dropped); padding -1."""
    B, H, N = state.log_sizes.shape
    valid = state.valid
    rep = valid & (torch.rand(B, H, N, generator=gen) < p_rep)
    parent = torch.full((B, H, N), -1, dtype=torch.long)
    for b in range(B):
        for h in range(H):
            reps = rep[b, h].nonzero().squeeze(1)
            for n in valid[b, h].nonzero().squeeze(1).tolist():
                if rep[b, h, n]:
                    parent[b, h, n] = n
                elif reps.numel() and float(torch.rand(1, generator=gen)) >= p_drop:
                    parent[b, h, n] = int(reps[int(torch.randint(0, reps.numel(), (1,), generator=gen))])
    return parent


def _clone(state: KVState) -> KVState:
    own = {k: v.clone() for k, v in vars(state).items() if isinstance(v, torch.Tensor)}
    return state.replace(**own, stats={k: v.clone() for k, v in state.stats.items()})


def _to_work(plan: torch.Tensor, work: KVState) -> torch.Tensor:
    """A plan over the compacted slots -> the same plan over the working state's slots (the j-th
    valid slot of a head of ``work`` is slot j of the compacted state)."""
    B, H, N = work.log_sizes.shape
    out = torch.full((B, H, N), -1, dtype=torch.long)
    for b in range(B):
        for h in range(H):
            slots = work.valid[b, h].nonzero().squeeze(1).tolist()
            for j, s in enumerate(slots):
                p = int(plan[b, h, j])
                out[b, h, s] = slots[p] if p >= 0 else -1
    return out


@CORE_SETTINGS
@given(seed=st.integers(0, 2**31 - 1), B=st.integers(1, 2), H=st.integers(1, 3), N=st.integers(1, 60),
       D=st.integers(1, 8), pad=st.integers(0, 5), p_rep=st.sampled_from([0.1, 0.5, 1.0]),
       p_drop=st.sampled_from([0.0, 0.3]), weighting=st.sampled_from(["size", "uniform"]),
       counts=st.booleans(), protected=st.booleans(), rounds=st.integers(1, 3),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_merge_in_place_then_compact_equals_apply_merge_plan(seed, B, H, N, D, pad, p_rep, p_drop, weighting,
                                                             counts, protected, rounds, dtype):
    state = _state(seed, B, H, N, D, pad, dtype=dtype, counts=counts, protected=protected)
    gen = torch.Generator().manual_seed(seed + 1)
    # round 0 as the pipeline does it (compacting: fresh tensors), later rounds both ways
    ref = apply_merge_plan(state, _random_plan(gen, state, p_rep, p_drop), weighting)
    work = _clone(ref)
    slots0 = work.num_slots
    for _ in range(rounds):
        plan = _random_plan(gen, ref, p_rep, p_drop)
        ref = apply_merge_plan(ref, plan, weighting)
        work = merge_in_place(work, _to_work(plan, work), weighting)
        assert work.num_slots == slots0  # nothing compacted until the end
    _same_state(compact(work), ref)


@pytest.mark.parametrize("seed", range(4))
def test_merge_in_place_writes_only_its_working_state(seed):
    state = _state(seed, 2, 2, 40, 4, 3, counts=True)
    gen = torch.Generator().manual_seed(seed)
    work = _clone(state)
    merge_in_place(work, _random_plan(gen, work, 0.3, 0.2))
    again = _clone(state)
    assert torch.equal(state.keys, again.keys) and torch.equal(state.log_sizes, again.log_sizes)
    assert not torch.equal(work.valid, state.valid)  # merged slots became padding where they stood
    assert work.num_slots == state.num_slots


def _pipelines(name, **overrides):
    fast = kc.Pipeline(name, **overrides)
    slow = kc.Pipeline(name, **overrides)
    slow._rounds_in_place = False  # the previous path: merge and compact every round
    return fast, slow


def test_which_pipelines_run_rounds_in_place():
    assert kc.Pipeline("centroidkv")._rounds_in_place
    assert kc.Pipeline("kvzip-csm-tokens")._rounds_in_place  # persistent guard: its marks only
    assert kc.Pipeline("centroidkv", guards=[{"name": "never-merge", "params": {"spans": [[3, 9]]}}])._rounds_in_place
    assert not kc.Pipeline("semanticache")._rounds_in_place  # delimiter chunker: not declared hole-tolerant


@CORE_SETTINGS
@given(seed=st.integers(0, 2**31 - 1), B=st.integers(1, 2), H=st.integers(1, 3), N=st.integers(8, 300),
       D=st.integers(1, 8), pad=st.integers(0, 7), keep=st.floats(0.05, 0.9),
       chunk=st.sampled_from([4, 16, 64]), partition=st.sampled_from(["alternating", "contiguous", "random"]),
       schedule=st.sampled_from([(0.5, 0.1, 0.1), (0.3, 0.0, 0.3), (0.5, 0.2, 0.0)]),
       guard=st.booleans(), protected=st.booleans(), counts=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_csm_rounds_in_place_equal_rounds_compacted(seed, B, H, N, D, pad, keep, chunk, partition, schedule, guard,
                                                    protected, counts, dtype):
    state = _state(seed, B, H, N, D, pad, dtype=dtype, counts=counts, protected=protected)
    r_init, delta_r, r_min = schedule
    overrides = {"keep_ratio": keep, "sinks": 2, "recent": 3, "on_infeasible": "best_effort",
                 "chunker.size": chunk, "clusterer.partition": partition, "clusterer.r_init": r_init,
                 "clusterer.delta_r": delta_r, "clusterer.r_min": r_min}
    if guard:
        overrides["guards"] = [{"name": "never-merge", "params": {"spans": [[N // 3, N // 2]]}}]
    fast, slow = _pipelines("centroidkv", **overrides)
    snap = _clone(state)
    got, rep = fast.compress(state, 0)
    want, rep_ref = slow.compress(state, 0)
    _same_state(got, want)
    assert rep.rounds == rep_ref.rounds and rep.num_slots == rep_ref.num_slots
    assert torch.equal(rep.slots_per_head, rep_ref.slots_per_head) and rep.budget_met == rep_ref.budget_met
    _same_state(state, snap, exact=True)  # the input is never written into


@pytest.mark.parametrize("name", ["kvzip-csm", "kvzip-csm-tokens"])
def test_importance_csm_presets_in_place_equal_compacted(name):
    from kvcompress.strategies.importance import STAT

    gen = torch.Generator().manual_seed(7)
    layers = [_state(s, 1, 2, 400, 8, 0) for s in range(3)]
    layers = [st.replace(stats={**st.stats, STAT: torch.rand(1, 2, 400, generator=gen)}) for st in layers]
    fast, slow = _pipelines(name, keep_ratio=0.25, on_infeasible="best_effort")
    fast.prepare(layers)
    slow.prepare(layers)
    for i, st in enumerate(layers):
        got, rep = fast.compress(st, i)
        want, rep_ref = slow.compress(st, i)
        _same_state(got, want)
        assert rep.rounds == rep_ref.rounds > 1


class _Fixed:
    """A clusterer that returns one given plan (for the pipeline's plan checks)."""

    def __init__(self, parent):
        self.parent = parent

    def __call__(self, state, chunk_ids, target, round_idx=0):
        from kvcompress.protocols import ClusterPlan

        return ClusterPlan(self.parent.clone(), done=True)


@pytest.mark.parametrize("bad", ["protected", "into_protected", "across_chunks", "unchunked"])
def test_plan_checks_reject_every_broken_invariant(bad):
    N = 32
    state = _state(0, 1, 1, N, 4, 0)
    pipe = kc.Pipeline("centroidkv", keep_ratio=0.5, sinks=2, recent=2, **{"chunker.size": 8})
    chunks = pipe.chunking(state, 0)
    slot = torch.arange(N).view(1, 1, N)
    parent = slot.clone()
    ids = chunks.chunk_ids[0, 0]
    if bad == "protected":
        parent[0, 0, 0] = 5  # a sink merged away
    elif bad == "into_protected":
        parent[0, 0, 5] = 0  # a slot merged into a sink
    elif bad == "across_chunks":
        a, b = int((ids == 0).nonzero()[0]), int((ids == 1).nonzero()[0])
        parent[0, 0, b] = a
    else:
        chunks_ids = chunks.chunk_ids.clone()
        pipe.chunker = lambda st, prot: torch.where(slot == 7, -1, chunks_ids)  # slot 7 in no chunk
        parent[0, 0, 7] = int((ids == ids[7]).nonzero()[0]) if int((ids == ids[7]).nonzero()[0]) != 7 else 6
    pipe.clusterer = _Fixed(parent)
    with pytest.raises(RuntimeError, match="clusterer"):
        pipe.compress(state, 0)


def test_plan_checks_accept_a_valid_merge():
    N = 32
    state = _state(1, 1, 1, N, 4, 0)
    pipe = kc.Pipeline("centroidkv", keep_ratio=0.5, sinks=2, recent=2, on_infeasible="best_effort",
                       **{"chunker.size": 8})
    ids = pipe.chunking(state, 0).chunk_ids[0, 0]
    parent = torch.arange(N).view(1, 1, N).clone()
    members = (ids == 0).nonzero().squeeze(1)
    parent[0, 0, members[1:]] = int(members[0])  # chunk 0 into its first slot
    pipe.clusterer = _Fixed(parent)
    out, _ = pipe.compress(state, 0)
    assert out.num_slots == N - (members.numel() - 1)
