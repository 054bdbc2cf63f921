"""CentroidKV's chunked soft matching: brute-force references, invariants, schedule, bad input."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcompress as kc
from kvcompress.attention import expand_state, proportional_attention
from kvcompress.registry import CHUNKERS, CLUSTERERS
from kvcompress.strategies.csm import ChunkedSoftMatching, CSMChunker
from kvcompress.strategies.partitions import split_ab

FAST = settings(max_examples=15, deadline=None)


def random_state(B, H, N, D, seed, pad=None):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(B, H, N, D, generator=g)
    values = torch.randn(B, H, N, D, generator=g)
    mask = None
    if pad is not None:
        mask = torch.ones(B, N, dtype=torch.long)
        for b, p in enumerate(pad):
            mask[b, :p] = 0
    return kc.KVState.from_raw(keys, values, attention_mask=mask)


def small_pipeline(**kw):
    base = dict(sinks=2, recent=3, keep_ratio=0.5)
    base.update(kw)
    return kc.Pipeline("centroidkv", **base)


# ---------------------------------------------------------------- brute-force reference
def reference_round(state, chunk_ids, target, r, partition):
    """One CSM round with Python loops: returns the set of (b, h, src, dst) merges and the
    per-A best-B cosines, computed pair by pair in float64."""
    B, H, N, _ = state.keys.shape
    valid = state.valid
    merges = {}
    best_of = {}
    for b in range(B):
        for h in range(H):
            chunks = {}
            for n in range(N):
                c = int(chunk_ids[b, h, n])
                if c >= 0 and bool(valid[b, h, n]):
                    chunks.setdefault(c, []).append(n)
            edges = []
            for c in sorted(chunks):
                members = chunks[c]
                L = len(members)
                if partition == "alternating":
                    a_set = [members[j] for j in range(L) if j % 2 == 1]
                elif partition == "contiguous":
                    a_set = members[: L // 2]
                else:
                    raise AssertionError(partition)
                b_set = [m for m in members if m not in a_set]
                for a in a_set:
                    ka = state.keys[b, h, a].double()
                    best, best_b = -math.inf, None
                    cos = {}
                    for bb in b_set:
                        kb = state.keys[b, h, bb].double()
                        s = float(ka @ kb / (ka.norm() * kb.norm()))
                        cos[bb] = s
                        if s > best:
                            best, best_b = s, bb
                    best_of[(b, h, a)] = cos
                    edges.append((best, a, best_b))
            free = sum(len(m) for m in chunks.values())
            slots = int(valid[b, h].sum())
            need = max(slots - int(target[b, h]), 0)
            k = min(math.ceil(r * free - 1e-9), len(edges), need)
            edges.sort(key=lambda e: -e[0])
            merges[(b, h)] = (edges[:k], edges[k:])
    return merges, best_of


@FAST
@given(
    B=st.integers(1, 2), H=st.integers(1, 2), N=st.integers(6, 48), D=st.integers(2, 6),
    chunk=st.integers(2, 12), keep=st.floats(0.3, 1.0), r=st.sampled_from([0.5, 0.3, 0.1]),
    partition=st.sampled_from(["alternating", "contiguous"]), seed=st.integers(0, 10_000),
)
def test_matching_equals_brute_force(B, H, N, D, chunk, keep, r, partition, seed):
    state = random_state(B, H, N, D, seed)
    pipe = small_pipeline(keep_ratio=keep)
    protected = pipe.protection(state)
    chunk_ids = CSMChunker(size=chunk)(state, protected)
    target = pipe.target_slots(state)
    plan = ChunkedSoftMatching(r_init=r, delta_r=0.0, r_min=r, partition=partition)(state, chunk_ids, target, 0)
    ref, cosines = reference_round(state, chunk_ids, target, r, partition)
    slot = torch.arange(N)
    for (b, h), (taken, left) in ref.items():
        parent = plan.parent[b, h]
        merged = {int(n) for n in slot[(parent != slot) & (parent >= 0)]}
        assert len(merged) == len(taken)
        for n in merged:
            # the clusterer's B is the best B (up to float32 rounding of the cosine)
            cos = cosines[(b, h, n)]
            assert cos[int(parent[n])] >= max(cos.values()) - 1e-5
        if taken and left:
            # the merged edges are the top-k of the pooled edges of the head
            chosen = [max(cosines[(b, h, n)].values()) for n in merged]
            rest = [e[0] for e in left if e[1] not in merged]
            if rest:
                assert min(chosen) >= max(rest) - 1e-5


@FAST
@given(N=st.integers(4, 60), chunk=st.integers(2, 16), seed=st.integers(0, 1000),
       partition=st.sampled_from(["alternating", "contiguous", "random"]))
def test_a_never_merges_into_a_and_at_most_half_per_chunk(N, chunk, seed, partition):
    state = random_state(1, 2, N, 4, seed)
    pipe = small_pipeline(keep_ratio=0.1 if N > 40 else 0.5, on_infeasible="best_effort")
    protected = pipe.protection(state)
    chunk_ids = CSMChunker(size=chunk)(state, protected)
    target = torch.zeros(1, 2, dtype=torch.long)  # ask for everything: the caps must bind
    plan = ChunkedSoftMatching(partition=partition, seed=seed)(state, chunk_ids, target, 0)
    parent = plan.parent
    slot = torch.arange(N)
    merged = (parent != slot) & (parent >= 0)
    # every destination is a representative that stays (a B token): no chains, no A -> A
    dest = parent.clamp(min=0)
    assert bool((parent.gather(-1, dest)[merged] == dest[merged]).all())
    for h in range(2):
        for c in chunk_ids[0, h].unique():
            if c < 0:
                continue
            members = (chunk_ids[0, h] == c).nonzero().squeeze(1)
            n_merged = int(merged[0, h, members].sum())
            assert n_merged <= len(members) // 2
            # destinations stay inside the chunk
            assert bool((chunk_ids[0, h, dest[0, h, members][merged[0, h, members]]] == c).all())
            if partition == "alternating":
                local = {int(m): j for j, m in enumerate(members)}
                for m in members[merged[0, h, members]]:
                    assert local[int(m)] % 2 == 1  # A = odd local index
                    assert local[int(parent[0, h, m])] % 2 == 0  # into B = even
    free = int(((chunk_ids >= 0)[0, 0]).sum())
    assert int(merged[0, 0].sum()) <= math.ceil(0.5 * free)


def test_split_ab_sizes_and_random_seed():
    mask = torch.arange(9)[None, :] < torch.tensor([[9], [4], [1], [0]])  # [4, 9]
    for partition in ("alternating", "contiguous", "random"):
        g = torch.Generator().manual_seed(3)
        is_a = split_ab(mask, partition, g)
        assert is_a.sum(1).tolist() == [4, 2, 0, 0]
        assert not bool((is_a & ~mask).any())
    a1 = split_ab(mask, "random", torch.Generator().manual_seed(5))
    a2 = split_ab(mask, "random", torch.Generator().manual_seed(5))
    assert torch.equal(a1, a2)


# ---------------------------------------------------------------- whole pipeline
@FAST
@given(
    B=st.integers(1, 2), H=st.integers(1, 3), N=st.integers(40, 90), keep=st.floats(0.2, 0.9),
    chunk=st.sampled_from([2, 4, 16, 256]), seed=st.integers(0, 10_000),
    partition=st.sampled_from(["alternating", "contiguous", "random"]),
    pad=st.booleans(),
)
def test_pipeline_meets_budget_exactly_and_degrees_add_up(B, H, N, keep, chunk, seed, partition, pad):
    pads = [0] + [seed % 5] * (B - 1) if pad else None
    state = random_state(B, H, N, 8, seed, pad=pads)
    pipe = small_pipeline(keep_ratio=keep, **{"chunker.size": chunk, "clusterer.partition": partition})
    out, report = pipe.compress(state)
    assert report.budget_met
    real = state.real_tokens()
    target = torch.floor(real.double() * keep + 1e-9).long().clamp(min=1)
    assert torch.equal(out.valid.sum(-1), target[:, None].expand(B, H))  # exactly the budget
    sizes = out.log_sizes.exp().sum(-1)
    assert torch.allclose(sizes, real[:, None].float().expand(B, H), atol=1e-3)
    assert bool((out.positions[~out.valid] == -1).all())


@FAST
@given(N=st.integers(200, 300), seed=st.integers(0, 1000), keep=st.floats(0.45, 0.8))
def test_sinks_and_recent_untouched(N, seed, keep):
    state = random_state(1, 2, N, 8, seed)
    pipe = kc.Pipeline("centroidkv", keep_ratio=keep, **{"chunker.size": 16})
    out, report = pipe.compress(state)
    assert report.rounds >= 1
    for h in range(2):
        pos = out.positions[0, h]
        for t in list(range(16)) + list(range(N - 64, N)):
            idx = (pos == t).nonzero()
            assert idx.numel() == 1, f"token {t} lost its slot"
            i = int(idx)
            assert float(out.log_sizes[0, h, i]) == 0.0
            assert torch.equal(out.keys[0, h, i], state.keys[0, h, t])
            assert torch.equal(out.values[0, h, i], state.values[0, h, t])


@FAST
@given(N=st.integers(45, 120), seed=st.integers(0, 1000), keep=st.floats(0.15, 0.7),
       chunk=st.sampled_from([2, 8, 32]))
def test_multi_round_attention_equals_expanded_cache(N, seed, keep, chunk):
    state = random_state(1, 2, N, 8, seed)
    pipe = small_pipeline(keep_ratio=keep, **{"chunker.size": chunk, "clusterer.delta_r": 0.2,
                                              "clusterer.r_min": 0.05})
    out, report = pipe.compress(state)
    q = torch.randn(1, 4, 5, 8, generator=torch.Generator().manual_seed(seed))
    got = proportional_attention(q, out.keys, out.values, out.log_sizes, causal=False)
    ek, ev, els = expand_state(out)
    ref = proportional_attention(q, ek, ev, els, causal=False)
    assert torch.allclose(got, ref, atol=1e-5)


@FAST
@given(N=st.integers(60, 100), seed=st.integers(0, 1000), keep=st.floats(0.1, 0.6))
def test_centroids_are_degree_weighted_means_of_their_tokens(N, seed, keep):
    """Carry a one-hot membership per slot through the rounds (per-slot extras add up on merge):
    every final key/value must be the plain mean of the original tokens it stands for."""
    state = random_state(1, 2, N, 4, seed)
    onehot = torch.eye(N).expand(1, 2, N, N).clone()
    state = state.replace(stats={"members": onehot})
    out, report = small_pipeline(keep_ratio=keep, **{"chunker.size": 8}).compress(state)
    members = out.stats["members"]  # [1, 2, M, N] counts
    size = out.log_sizes.exp()
    assert torch.allclose(members.sum(-1)[out.valid], size[out.valid], atol=1e-4)
    mean_k = members @ state.keys / members.sum(-1, keepdim=True).clamp(min=1)
    mean_v = members @ state.values / members.sum(-1, keepdim=True).clamp(min=1)
    assert torch.allclose(out.keys[out.valid], mean_k[out.valid], atol=1e-5)
    assert torch.allclose(out.values[out.valid], mean_v[out.valid], atol=1e-5)


def test_schedule_and_rounds():
    c = ChunkedSoftMatching(r_init=0.5, delta_r=0.15, r_min=0.1)
    assert [c.rate(j) for j in range(5)] == pytest.approx([0.5, 0.35, 0.2, 0.1, 0.1])
    fixed = ChunkedSoftMatching(r_init=0.3, delta_r=0.0, r_min=0.3)
    assert {fixed.rate(j) for j in range(5)} == {0.3}
    state = random_state(1, 1, 1000, 8, 0)
    _, rep = kc.Pipeline("centroidkv", keep_ratio=0.25).compress(state)
    # 920 clusterable: -460 (r=0.5) -> 540 slots; -184 (0.4 of 460) -> 356; -83 (0.3 of 276) -> 273;
    # then only the 23 still needed (0.2 of 193 would allow 39)
    assert rep.rounds == 4
    _, rep = kc.Pipeline("centroidkv", keep_ratio=0.25, **{"clusterer.r_init": 0.2, "clusterer.delta_r": 0.0,
                                                          "clusterer.r_min": 0.2}).compress(state)
    assert rep.rounds > 3


def test_progressive_rounds_are_more_selective():
    """Later rounds merge fewer edges (r falls), so the schedule is visible in the plans."""
    state = random_state(1, 1, 2000, 8, 1)
    pipe = kc.Pipeline("centroidkv", keep_ratio=0.1)
    cur, merged_per_round = state, []
    for j in range(4):
        prot = pipe.protection(cur)
        cids = pipe.chunker(cur, prot)
        plan = pipe.clusterer(cur, cids, pipe.target_slots(state), j)
        slot = torch.arange(cur.num_slots)
        merged_per_round.append(int(((plan.parent != slot) & (plan.parent >= 0)).sum()))
        free = int((cids >= 0).sum())
        assert merged_per_round[-1] == math.ceil(pipe.clusterer.rate(j) * free - 1e-9)
        cur = pipe.merger(cur, plan.parent)
    assert merged_per_round == sorted(merged_per_round, reverse=True)


def test_random_partition_is_seeded():
    state = random_state(1, 2, 300, 8, 4)
    a, _ = kc.Pipeline("centroidkv-random", keep_ratio=0.3).compress(state)
    b, _ = kc.Pipeline("centroidkv-random", keep_ratio=0.3).compress(state)
    c, _ = kc.Pipeline("centroidkv-random", keep_ratio=0.3, **{"clusterer.seed": 9}).compress(state)
    assert torch.equal(a.keys, b.keys)
    assert not torch.equal(a.positions, c.positions)


@pytest.mark.parametrize("name", ["centroidkv", "centroidkv-chunk16", "centroidkv-chunk64", "centroidkv-chunk256",
                                  "centroidkv-contiguous", "centroidkv-random", "centroidkv-fixed-r"])
def test_presets(name):
    cfg = kc.get_preset(name)
    assert (cfg.sinks, cfg.recent, cfg.merger.name, cfg.clusterer.name) == (16, 64, "degree", "csm")
    assert kc.PipelineConfig.from_json(cfg.to_json()) == cfg
    state = random_state(1, 2, 700, 8, 2)
    out, rep = kc.Pipeline(cfg, keep_ratio=0.3).compress(state)
    assert rep.budget_met and int(out.valid.sum(-1).max()) == 210


def test_full_heads_keep_their_cache():
    state = random_state(1, 3, 300, 8, 0)
    out, _ = kc.Pipeline("centroidkv", full_heads=[[2, 1]]).compress(state, layer_idx=2)
    assert out.valid.sum(-1).tolist() == [[150, 300, 150]]
    assert torch.equal(out.keys[0, 1, :300], state.keys[0, 1])


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize("params", [
    {"r_init": 0.0}, {"r_init": 0.6}, {"r_init": -0.1}, {"r_init": float("nan")}, {"r_init": "0.5"},
    {"delta_r": -0.1}, {"r_min": 0.6}, {"r_min": -0.01}, {"r_init": 0.2, "r_min": 0.3},
    {"partition": "zigzag"}, {"seed": -1},
])
def test_bad_clusterer_params(params):
    with pytest.raises(ValueError) as err:
        CLUSTERERS.create("csm", params)
    assert next(iter(params)) in str(err.value) or "r_min" in str(err.value)


@pytest.mark.parametrize("size", [1, 0, -3, 2.5])
def test_bad_chunk_size(size):
    with pytest.raises(ValueError, match="size"):
        CHUNKERS.create("csm", {"size": size})
    with pytest.raises(ValueError, match="size"):
        kc.Pipeline("centroidkv", **{"chunker.size": size})


def snapshot(state):
    return [t.clone() for t in (state.keys, state.values, state.log_sizes, state.positions)]


def unchanged(state, snap):
    return all(torch.equal(a, b) for a, b in zip((state.keys, state.values, state.log_sizes, state.positions), snap))


def test_budget_below_sinks_plus_recent_is_a_clear_value_error():
    state = random_state(1, 2, 400, 8, 0)
    snap = snapshot(state)
    with pytest.raises(ValueError, match="sinks=16, recent=64") as err:
        kc.Pipeline("centroidkv", max_slots=60, on_infeasible="error").compress(state)
    assert isinstance(err.value, kc.BudgetError)
    assert unchanged(state, snap)


@pytest.mark.parametrize("overrides", [
    {"clusterer.r_min": 0.0, "clusterer.delta_r": 0.5},  # r: 0.5, then 0 forever
    {"max_rounds": 1},
])
def test_schedules_that_never_reach_the_budget(overrides):
    state = random_state(1, 2, 1000, 8, 0)
    snap = snapshot(state)
    with pytest.raises(kc.BudgetError, match="keep_ratio=0.1"):
        kc.Pipeline("centroidkv", keep_ratio=0.1, on_infeasible="error", **overrides).compress(state)
    assert unchanged(state, snap)
    # the documented fallback: best effort returns what it reached and says so
    out, rep = kc.Pipeline("centroidkv", keep_ratio=0.1, on_infeasible="best_effort", **overrides).compress(state)
    assert not rep.budget_met and rep.rounds <= 2
    assert int(out.valid.sum(-1).max()) < 1000 and unchanged(state, snap)
