"""Session 11's faster paths against the code they replace, bit for bit:

- CSM's edge ranking sorts the float64 key's bits as int64 (``_stable_argsort_nonnegative``) and
  writes the plan from the selected edges only: the plans must equal main's (tests/slow_reference/
  csm_v0.py, verbatim) on random states with exact ties, near-duplicate keys and every partition;
- GSC's search of the values inside a narrow threshold bracket (``_count_below_picked``) searches
  one table of int64 order keys: its slots must equal ``searchsorted``'s per segment, signed zeros,
  subnormals, ties and duplicated thresholds included.
"""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

import kvcompress as kc
from conftest import CORE_SETTINGS
from kvcompress.strategies import csm as fast_csm
from kvcompress.strategies import gsc as fast_gsc
from slow_reference import csm_v0 as slow_csm


def _csm_state(seed, B, H, N, D, duplicates, p_invalid):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(B, H, N, D, generator=gen)
    if duplicates == "exact" and N > 2:  # identical keys: cosines tie exactly, edges tie in the ranking
        keys[..., 2::3, :] = keys[..., 0:1, :]
    elif duplicates == "near" and N > 2:  # cosines a few ulps apart: ties in the rounded float64 key
        M = keys[..., 1::2, :].shape[-2]
        keys[..., 1::2, :] = keys[..., :1, :] * (1 + 1e-7 * torch.randn(B, H, M, 1, generator=gen))
    values = torch.randn(B, H, N, D, generator=gen)
    state = kc.KVState.from_raw(keys, values)
    invalid = torch.rand(B, H, N, generator=gen) < p_invalid
    return state.replace(log_sizes=state.log_sizes.masked_fill(invalid, float("-inf"))), gen


@CORE_SETTINGS
@given(seed=st.integers(0, 2**31 - 1), B=st.integers(1, 2), H=st.integers(1, 3), N=st.integers(2, 300),
       D=st.sampled_from([1, 2, 8]), size=st.sampled_from([2, 5, 16, 64]),
       partition=st.sampled_from(["alternating", "contiguous", "random"]),
       duplicates=st.sampled_from(["none", "exact", "near"]), p_invalid=st.sampled_from([0.0, 0.2]),
       p_out=st.sampled_from([0.0, 0.3]), keep=st.floats(0.05, 1.0), round_idx=st.integers(0, 4))
def test_csm_plans_equal_mains(seed, B, H, N, D, size, partition, duplicates, p_invalid, p_out, keep, round_idx):
    state, gen = _csm_state(seed, B, H, N, D, duplicates, p_invalid)
    protected = torch.rand(B, H, N, generator=gen) < p_out
    chunk_ids = fast_csm.CSMChunker(size=size)(state, protected)
    target = torch.floor(state.valid.sum(-1).double() * keep).long()
    new = fast_csm.ChunkedSoftMatching(partition=partition)(state, chunk_ids, target, round_idx)
    old = slow_csm.ChunkedSoftMatching(partition=partition)(state, chunk_ids, target, round_idx)
    assert torch.equal(new.parent, old.parent) and new.done == old.done


@CORE_SETTINGS
@given(seed=st.integers(0, 2**31 - 1), E=st.integers(0, 3000), R=st.integers(1, 6),
       scores=st.sampled_from(["uniform", "few", "tiny", "extremes"]))
def test_int64_argsort_of_the_ranking_key_equals_the_float_one(seed, E, R, scores):
    gen = torch.Generator().manual_seed(seed)
    row = torch.randint(0, R, (E,), generator=gen)
    if scores == "uniform":
        score = torch.rand(E, generator=gen) * 2 - 1
    elif scores == "few":  # many exact ties
        score = torch.tensor([-1.0, -0.5, 0.0, 0.25, 1.0])[torch.randint(0, 5, (E,), generator=gen)]
    elif scores == "tiny":  # distinct float32 scores whose float64 keys round to ties
        score = (torch.rand(E, generator=gen) - 0.5) * 1e-12
    else:
        score = torch.tensor([-1.0, 1.0, -0.0, 0.0, 1e-38, -1e-45])[torch.randint(0, 6, (E,), generator=gen)]
    key = row.double() * 4.0 + (1.0 - score.double().clamp(-1.0, 1.0))
    assert torch.equal(fast_csm._stable_argsort_nonnegative(key), key.argsort(stable=True))
    order, rank = fast_csm.rank_within_rows(row, score, R)
    old_order, old_rank = slow_csm.rank_within_rows(row, score, R)
    assert torch.equal(order, old_order) and torch.equal(rank, old_rank)


def test_nan_keys_keep_the_float_sort():
    key = torch.tensor([2.0, float("nan"), 1.0, -float("nan"), 0.0], dtype=torch.float64)
    assert torch.equal(fast_csm._stable_argsort_nonnegative(key), key.argsort(stable=True))


@CORE_SETTINGS
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(0, 500), S=st.integers(1, 6), C=st.integers(1, 20),
       kind=st.sampled_from(["uniform", "narrow", "zeros", "subnormal", "duplicates"]))
def test_count_below_picked_equals_searchsorted(seed, n, S, C, kind):
    gen = torch.Generator().manual_seed(seed)
    if kind == "uniform":
        tau = torch.rand(S, C, generator=gen) * 2 - 1
    elif kind == "narrow":
        tau = 0.3 + (torch.rand(S, C, generator=gen) - 0.5) * 1e-6
    elif kind == "zeros":  # +0.0 and -0.0 among the thresholds and the values
        tau = torch.tensor([-0.0, 0.0, -1e-30, 1e-30, 0.5])[torch.randint(0, 5, (S, C), generator=gen)]
    elif kind == "subnormal":
        tau = torch.tensor([1e-45, -1e-45, 1e-40, -1e-39, 0.0])[torch.randint(0, 5, (S, C), generator=gen)]
    else:
        tau = torch.tensor([-0.25, 0.0, 0.75])[torch.randint(0, 3, (S, C), generator=gen)]
    tau = tau.sort(1).values
    seg = torch.randint(0, S, (n,), generator=gen)
    # values: the thresholds themselves (ties), their neighbours one ulp away, zeros of both signs, any
    at = tau.reshape(-1)[torch.randint(0, S * C, (n,), generator=gen)]
    pool = torch.stack([at, torch.nextafter(at, torch.tensor(2.0)), torch.nextafter(at, torch.tensor(-2.0)),
                        torch.full_like(at, -0.0), torch.full_like(at, 0.0), torch.rand(n, generator=gen) * 2 - 1,
                        torch.full_like(at, fast_gsc._EXCLUDED)], 1) if n else torch.zeros(0, 7)
    vals = pool[torch.arange(n), torch.randint(0, 7, (n,), generator=gen)] if n else torch.zeros(0)
    want = torch.searchsorted(tau.index_select(0, seg), vals[:, None]).squeeze(1)
    assert torch.equal(fast_gsc._count_below_picked(vals, seg, tau), want)
    # a transposed (non-contiguous) threshold table, as the search passes give it
    assert torch.equal(fast_gsc._count_below_picked(vals, seg, tau.t().contiguous().t()), want)


def test_count_below_picked_nan_thresholds_fall_back():
    tau = torch.tensor([[0.0, 0.5, float("nan")]])
    vals = torch.tensor([0.25, 0.75, -1.0])
    seg = torch.zeros(3, dtype=torch.long)
    want = torch.searchsorted(tau.index_select(0, seg), vals[:, None]).squeeze(1)
    assert torch.equal(fast_gsc._count_below_picked(vals, seg, tau), want)


# ---------------------------------------------------------------------------------------------
# h16 (session 14): D2O's search without a sort in ``_compact``, whole-row index_selects and a buffered re-score,
# against session 12's (tests/slow_reference/d2o_v3.py, verbatim), bit for bit.

from kvcompress.strategies import d2o as fast_d2o  # noqa: E402
from slow_reference import d2o_v3 as slow_d2o  # noqa: E402


@CORE_SETTINGS
@given(seed=st.integers(0, 10_000), B=st.integers(1, 2), H=st.integers(1, 3), N=st.integers(1, 200),
       p=st.sampled_from([0.0, 0.3, 0.7, 1.0]))
def test_compact_equals_the_stable_sort(seed, B, H, N, p):
    mask = torch.rand(B, H, N, generator=torch.Generator().manual_seed(seed)) < p
    order, ok = fast_d2o._compact(mask)
    order0, ok0 = slow_d2o._compact(mask)
    assert torch.equal(order, order0) and torch.equal(ok, ok0)


def _d2o_case(seed, B, H, N, D, chunks, dup, uneven, common, p_keep):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(B, H, N, D, generator=gen) + common * torch.randn(B, H, 1, D, generator=gen)
    if dup and N > 1:  # exact duplicates: receiving slots tie bit for bit (first slot wins)
        keys[:, :, 1::3] = keys[:, :, 0:N - 1:3][:, :, : keys[:, :, 1::3].shape[2]]
    chunk_ids = (torch.arange(N) * chunks // N).expand(B, H, N).clone()
    chunk_ids[:, :, :2] = -1  # sinks outside every chunk
    free = chunk_ids >= 0
    keep = torch.rand(B, H, N, generator=gen) < p_keep
    if uneven:  # one head keeps nothing, another evicts nothing
        keep[0, H - 1] = False
        keep[B - 1, 0] = True
    return keys, free & ~keep, free & keep, chunk_ids


@CORE_SETTINGS
@given(seed=st.integers(0, 10_000), B=st.integers(1, 2), H=st.integers(1, 3), N=st.integers(1, 260),
       D=st.sampled_from([4, 8, 64]), chunks=st.sampled_from([1, 3]), dup=st.booleans(), uneven=st.booleans(),
       common=st.sampled_from([0.0, 3.0, 30.0]), p_keep=st.sampled_from([0.1, 0.3, 0.6]),
       coarse=st.sampled_from([True, False, None]), entries=st.sampled_from([64, 4096, 1 << 21]))
def test_most_similar_kept_equals_session_12s(seed, B, H, N, D, chunks, dup, uneven, common, p_keep, coarse,
                                              entries):
    """Parents and float32 similarities bit for bit (parents only: single candidates not re-scored),
    one or several bfloat16 blocks (``entries``),
    blocks falling back to float32 (common = 30: keys this alike give many candidates), chunk masks,
    heads with no receiving or no evicted slot, exact ties."""
    args = _d2o_case(seed, B, H, N, D, chunks, dup, uneven, common, p_keep)
    old = fast_d2o._COARSE_ENTRIES
    fast_d2o._COARSE_ENTRIES = entries  # block_rows (shared by both) reads it
    try:
        parent, best = fast_d2o.most_similar_kept(*args, coarse=coarse)
        parent0, best0 = slow_d2o.most_similar_kept(*args, coarse=coarse)
        parent1, none = fast_d2o.most_similar_kept(*args, coarse=coarse, similarities=False)
    finally:
        fast_d2o._COARSE_ENTRIES = old
    assert torch.equal(parent, parent0) and torch.equal(parent1, parent0) and none is None
    assert torch.equal(best.view(torch.int32), best0.view(torch.int32))


def _same(x, y) -> bool:
    """Equal bit for bit (NaN included), same dtype and shape."""
    if x is None or y is None:
        return x is y
    if x.dtype != y.dtype or x.shape != y.shape:
        return False
    if x.dtype == torch.float32:
        x, y = x.contiguous().view(torch.int32), y.contiguous().view(torch.int32)
    return torch.equal(x, y)


def _equal_states(a, b) -> bool:
    fields = ("keys", "values", "log_sizes", "positions", "counts", "protected")
    return all(_same(getattr(a, n), getattr(b, n)) for n in fields) and a.num_tokens == b.num_tokens and \
        a.extras.keys() == b.extras.keys() and all(_same(a.extras[k], b.extras[k]) for k in a.extras)


@CORE_SETTINGS
@given(seed=st.integers(0, 10_000), B=st.integers(1, 2), H=st.integers(1, 3), N=st.integers(1, 120),
       D=st.sampled_from([4, 64]), threshold=st.sampled_from([None, 0.2, -1.0]), proportional=st.booleans(),
       sliced=st.booleans(), prior=st.booleans(), counts=st.booleans(), dup=st.booleans())
def test_d2o_merger_equals_session_12s(seed, B, H, N, D, threshold, proportional, sliced, prior, counts, dup):
    """The merged state bit for bit (keys, values, sizes, counts, tau), from D2O's own plan; keys as
    a slice of a longer buffer (a cache's view) or contiguous, with and without a previous tau."""
    gen = torch.Generator().manual_seed(seed)
    extra = 5 if sliced else 0
    keys = torch.randn(B, H, N + extra, D, generator=gen)[:, :, :N]
    if dup and N > 1:
        keys[:, :, 1::2] = keys[:, :, 0:N - 1:2][:, :, : keys[:, :, 1::2].shape[2]]
    st_ = kc.KVState.from_raw(keys, torch.randn(B, H, N + extra, D, generator=gen)[:, :, :N])
    if counts:
        st_ = st_.replace(counts=torch.randint(1, 4, (B, H, N), generator=gen).float())
    if prior:
        tau = torch.rand(B, H, generator=gen)
        tau[0, 0] = float("nan")
        st_ = st_.replace(extras={fast_d2o.TAU_KEY: tau})
    chunk_ids = torch.zeros(B, H, N, dtype=torch.long)
    keep = torch.rand(B, H, N, generator=gen) < 0.3
    candidate, _ = fast_d2o.most_similar_kept(st_.keys, ~keep, keep, chunk_ids)
    slot = torch.arange(N).expand(B, H, N)
    plan = torch.where(keep, slot, candidate)
    fast = fast_d2o.D2OMerger(threshold=threshold, proportional=proportional)
    slow = slow_d2o.D2OMerger(threshold=threshold, proportional=proportional)
    assert _equal_states(fast(st_, plan), slow(st_, plan))


@CORE_SETTINGS
@given(seed=st.integers(0, 10_000), P=st.integers(0, 300), D=st.sampled_from([1, 4, 64, 128]),
       R1=st.integers(1, 50), R2=st.integers(1, 50))
def test_rescore_equals_session_12s(seed, P, D, R1, R2):
    """The re-score on reused buffers equals the fresh-tensor loop bit for bit (and leaves its
    index arguments untouched)."""
    gen = torch.Generator().manual_seed(seed)
    a_t = torch.nn.functional.normalize(torch.randn(2, 3, R1, D, generator=gen), dim=-1).transpose(-1, -2).contiguous()
    b_t = torch.nn.functional.normalize(torch.randn(2, 3, R2, D, generator=gen), dim=-1).transpose(-1, -2).contiguous()
    m = torch.randint(0, 6, (P,), generator=gen)
    a_at = m * D * R1 + torch.randint(0, R1, (P,), generator=gen)
    b_at = m * D * R2 + torch.randint(0, R2, (P,), generator=gen)
    keep_a, keep_b = a_at.clone(), b_at.clone()
    got = fast_d2o.rescore(a_t, a_at, b_t, b_at)
    ref = slow_d2o.rescore(a_t, a_at, b_t, b_at)
    assert _same(got, ref) and torch.equal(a_at, keep_a) and torch.equal(b_at, keep_b)


def _rank_desc_v0(key, candidate):
    """eviction.rank_desc at main ffe1659, verbatim: always a stable sort."""
    _min = torch.finfo(torch.float32).min
    k = key.float().nan_to_num(nan=_min, posinf=float("inf"), neginf=_min)
    k = torch.where(candidate, k.clamp(min=_min), float("-inf"))
    order = torch.sort(k, dim=-1, descending=True, stable=True).indices
    ranks = torch.empty_like(order)
    ranks.scatter_(-1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order))
    return ranks


@CORE_SETTINGS
@given(seed=st.integers(0, 10_000), B=st.integers(1, 2), H=st.integers(1, 3), N=st.integers(0, 150),
       kind=st.sampled_from(["positions", "gaps", "ties", "random", "special", "big"]),
       p=st.sampled_from([0.0, 0.5, 1.0]))
def test_rank_desc_equals_the_sort(seed, B, H, N, kind, p):
    """The counting path (keys increasing along the candidates) and the sort give the same ranks;
    ties, NaN, infinities and long positions beyond float32's integers fall back to the sort."""
    from kvcompress.strategies.eviction import rank_desc

    gen = torch.Generator().manual_seed(seed)
    if kind == "positions":
        key = torch.arange(N).expand(B, H, N)
    elif kind == "gaps":
        key = torch.randint(1, 4, (B, H, N), generator=gen).cumsum(-1)
    elif kind == "ties":
        key = torch.randint(0, 3, (B, H, N), generator=gen).cumsum(-1)
    elif kind == "big":  # 2^24 + n: equal once rounded to float32
        key = (1 << 24) + torch.arange(N).expand(B, H, N)
    else:
        key = torch.randn(B, H, N, generator=gen).sort(-1).values if seed % 2 else torch.randn(B, H, N, generator=gen)
        if kind == "special" and N:
            key = key.clone()
            key.view(-1)[torch.randint(0, key.numel(), (3,), generator=gen)] = torch.tensor(
                [float("nan"), float("inf"), float("-inf")])
    candidate = torch.rand(B, H, N, generator=gen) < p
    assert torch.equal(rank_desc(key, candidate), _rank_desc_v0(key, candidate))


# ---------------------------------------------------------------------------------------------
# h14b (session 16, issue 14): the fitted merger's fit, bit for bit
# - ``_exp_``: the -inf padding rows of the fit's logits are filled with 0 around the exp instead of
#   being exponentiated (torch's CPU exp is 5-7x slower on -inf lanes): equal to ``exp_``;
# - ``refit(..., owned=True)``: the fitted rows written into the merge's own tensors instead of
#   into copies: the same state as ``owned=False``, which leaves ``merged`` untouched.

def _fit_state(seed, B, H, N, D, G, R, size, pad):
    g = torch.Generator().manual_seed(seed)
    run = torch.arange(N) // size
    keys = torch.randn(B, H, N, D, generator=g)[:, :, run] + 0.5 * torch.randn(B, H, N, D, generator=g)
    keys[:, :, : 2 * size] = keys[:, :, :1]  # a cluster of identical keys: kept as the merge's
    q = 2.0 * torch.randn(B, H * G, R, D, generator=g) * D ** 0.25
    state = kc.KVState.from_raw(keys, torch.randn(B, H, N, D, generator=g)).replace(extras={"queries": q})
    parent = (run * size).expand(B, H, N).clone()
    if pad:  # a padded head (its last slots padding, dropped): padding rows in the fit's heads
        ls = state.log_sizes.clone()
        ls[:, -1, -3 * size:] = float("-inf")
        state = state.replace(log_sizes=ls)
        parent[:, -1, -3 * size:] = -1
    drop = torch.rand(B, H, N, generator=g) < 0.1
    return state, torch.where(drop & (parent != torch.arange(N)), -1, parent), g


@CORE_SETTINGS
@given(seed=st.integers(0, 10_000), B=st.integers(1, 2), H=st.integers(1, 3), K=st.integers(1, 40),
       P=st.integers(1, 40), p_dead=st.sampled_from([0.0, 0.3, 1.0]))
def test_exp_of_dead_rows_equals_exp(seed, B, H, K, P, p_dead):
    """Rows of -inf (padding) among finite logits, -inf and very negative entries (0 and subnormal
    results) in the live rows too: ``_exp_`` equals ``exp_`` bit for bit."""
    from kvcompress.strategies.fitting import _dead_rows, _exp_

    gen = torch.Generator().manual_seed(seed)
    bias = torch.randn(B, H, K, generator=gen).masked_fill(torch.rand(B, H, K, generator=gen) < p_dead, float("-inf"))
    s = 30 * torch.randn(B, H, K, P, generator=gen) - 60 + bias[..., None]  # some below -87 and -104
    s.view(-1)[torch.randint(0, s.numel(), (3,), generator=gen)] = float("-inf")
    dead = _dead_rows(bias)
    assert (dead is None) == (not bool(bias.eq(float("-inf")).any()))
    assert torch.equal(_exp_(s.clone(), dead), s.exp())


@CORE_SETTINGS
@given(seed=st.integers(0, 10_000), B=st.integers(1, 2), H=st.integers(1, 3), N=st.integers(12, 80),
       G=st.integers(1, 3), R=st.integers(1, 8), size=st.integers(2, 5), refine=st.integers(0, 3),
       share=st.sampled_from([0.25, 1.0]), pad=st.booleans())
def test_refit_into_the_owned_merge_equals_the_copy(seed, B, H, N, G, R, size, refine, share, pad):
    from kvcompress.strategies.fitted import FittedMerger, ProportionalRounds

    state, parent, _ = _fit_state(seed, B, H, N, 8, G, R, size, pad)
    m = FittedMerger(reference_queries=R, refine=refine, refine_share=share)
    merged = ProportionalRounds()(state, parent)
    before = {n: getattr(merged, n).clone() for n in ("keys", "values", "log_sizes")}
    copied = m.refit(state, parent, merged)
    for n, x in before.items():  # not owned: merged is left as it was
        assert torch.equal(getattr(merged, n), x), n
    owned = m.refit(state, parent, merged, owned=True)
    for n in ("keys", "values", "log_sizes", "counts", "positions"):
        assert torch.equal(getattr(owned, n), getattr(copied, n)), n
    if not torch.equal(copied.keys, before["keys"]):  # something was fitted: written into merged's own tensors
        assert owned.keys.data_ptr() == merged.keys.data_ptr() and owned.values.data_ptr() == merged.values.data_ptr()
    assert torch.equal(m(state, parent).keys, copied.keys)  # __call__ owns its merge
