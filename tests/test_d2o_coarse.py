"""D2O's coarse nearest-kept search (issue 16): bfloat16 products, then every candidate within twice
the bfloat16 error bound of the row's maximum re-scored in float32, against the float32-only
search it replaces (tests/slow_reference/d2o_v2.py).

What must hold: the chosen receiving slot is the float32 argmax (first slot on ties), so it equals
the reference's except where two receiving slots are within float32 rounding of each other (then
either is the most similar; checked in float64); the similarities agree to float32 rounding; the
error bound holds for the products as computed; blocks with too many candidates or no clearly
positive maximum fall back to the float32 search bit for bit."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcompress.strategies.d2o as d2o
from kvcompress.strategies.d2o import coarse_error_bound, most_similar_kept
from slow_reference import d2o_v2

NEAR = 1e-6  # float32 rounding of a 64-term unit cosine is ~4e-6 at most; observed far below


def _case(seed: int, N: int, D: int, chunks: int, dup: bool, uneven: bool, common: float, B: int = 2, H: int = 3):
    """Random keys around a shared direction (``common``: how much of it; real keys' nearest kept
    cosines are 0.6 - 0.8 at 8k), sinks outside the chunks, ~30 % receiving slots."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(B, H, N, D, generator=gen) + common * torch.randn(B, H, 1, D, generator=gen)
    if dup:  # exact duplicates: ties between receiving slots
        keys[:, :, 1::3] = keys[:, :, 0:N - 1:3][:, :, : keys[:, :, 1::3].shape[2]]
    chunk_ids = (torch.arange(N) * chunks // N).expand(B, H, N).clone()
    chunk_ids[:, :, :2] = -1
    free = chunk_ids >= 0
    keep = torch.rand(B, H, N, generator=gen) < 0.3
    if uneven:  # one head keeps nothing, another evicts nothing
        keep[0, 1] = False
        keep[min(1, B - 1), H - 1] = True
    return keys, free & ~keep, free & keep, chunk_ids


class _Spy:
    """Counts the candidates re-scored (so a test knows the coarse search ran)."""

    def __init__(self, monkeypatch):
        self.pairs = 0
        real = d2o.rescore

        def spy(a_t, a_at, b_t, b_at):
            self.pairs += a_at.shape[0]
            return real(a_t, a_at, b_t, b_at)

        monkeypatch.setattr(d2o, "rescore", spy)


def _cos64(keys, p):
    unit = F.normalize(keys.double(), dim=-1)
    return (unit * unit.gather(2, p.clamp(min=0)[..., None].expand_as(unit))).sum(-1)


def _check(args, exact_where_unique: bool = True):
    keys = args[0]
    parent, best = most_similar_kept(*args, coarse=True)
    parent0, best0 = d2o_v2.most_similar_kept(*args)
    assert torch.equal(parent >= 0, parent0 >= 0)
    assert torch.equal(best == float("-inf"), best0 == float("-inf"))
    torch.testing.assert_close(best, best0, atol=NEAR, rtol=0)
    has = parent0 >= 0
    differs = has & (parent != parent0)
    # a different slot only at a float tie: as similar as the reference's in float64
    assert bool(((_cos64(keys, parent) - _cos64(keys, parent0)).abs()[differs] <= 2 * NEAR).all())
    if exact_where_unique:
        assert int(differs.sum()) <= max(1, int(has.sum()) // 50)
    return parent, best


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), N=st.integers(3, 150), D=st.sampled_from([4, 8, 64]),
       chunks=st.sampled_from([1, 2, 5]), dup=st.booleans(), uneven=st.booleans(),
       common=st.sampled_from([0.0, 1.0, 3.0]), entries=st.sampled_from([64, 1 << 21]))
def test_coarse_search_is_the_float32_search(seed, N, D, chunks, dup, uneven, common, entries):
    """Random cases, one or several bfloat16 blocks (``entries``), chunk masks, heads with no
    receiving or no evicted slot, partial column blocks, exact duplicates (ties: first slot)."""
    old = d2o._COARSE_ENTRIES
    d2o._COARSE_ENTRIES = entries
    try:
        _check(_case(seed, N, D, chunks, dup, uneven, common))
    finally:
        d2o._COARSE_ENTRIES = old


def test_coarse_search_runs_and_breaks_ties_to_the_first_slot(monkeypatch):
    """Exact duplicates among the receiving slots: the same float32 value, bit for bit, in both
    searches; the first slot wins in both. The coarse search really ran (candidates re-scored)."""
    spy = _Spy(monkeypatch)
    args = _case(5, 300, 64, 1, True, False, 1.0)
    parent, best = most_similar_kept(*args, coarse=True)
    parent0, best0 = d2o_v2.most_similar_kept(*args)
    assert spy.pairs > 0
    assert torch.equal(parent, parent0)
    assert torch.equal(best, best0)  # rescore rounds as the BLAS does here; else the test above's tolerance


@pytest.mark.parametrize("spacing", [1e-4, 1e-5])
def test_near_ties_below_bfloat16_resolution_are_resolved_in_float32(spacing, monkeypatch):
    """Adversarial: each evicted key has three receiving keys whose cosines with it differ by
    ``spacing`` (far below bfloat16's 2^-8 near 1), in a random order among far ones: the bfloat16
    values tie, the float32 re-score must pick the truly most similar one (float64 argmax)."""
    spy = _Spy(monkeypatch)
    gen = torch.Generator().manual_seed(11)
    B, H, E, D = 1, 2, 40, 64
    ev = F.normalize(torch.randn(B, H, E, D, generator=gen), dim=-1)
    far = torch.randn(B, H, 4 * E, D, generator=gen)
    near = []
    for j in range(3):  # cos(ev, near_j) = 0.995 - j * spacing, built exactly in float64
        c = 0.995 - j * spacing
        r = torch.randn(B, H, E, D, generator=gen, dtype=torch.float64)
        e64 = ev.double()
        r = F.normalize(r - (r * e64).sum(-1, keepdim=True) * e64, dim=-1)
        near.append((c * e64 + (1 - c * c) ** 0.5 * r).float())
    receivers = torch.cat(near + [far], 2)
    perm = torch.randperm(receivers.shape[2], generator=gen)
    keys = torch.cat([ev, receivers[:, :, perm]], 2)
    N = keys.shape[2]
    evicted = torch.zeros(B, H, N, dtype=torch.bool)
    evicted[..., :E] = True
    args = (keys, evicted, ~evicted, torch.zeros(B, H, N, dtype=torch.long))
    parent, best = most_similar_kept(*args, coarse=True)
    parent0, _ = d2o_v2.most_similar_kept(*args)
    assert spy.pairs >= 3 * B * H * E  # the three near ties of every row were re-scored
    unit = F.normalize(keys.double(), dim=-1)
    truth = (unit[:, :, :E] @ unit.transpose(-1, -2)).masked_fill(evicted[:, :, None, :], -2).argmax(-1)
    assert torch.equal(parent[..., :E], truth)
    assert torch.equal(parent, parent0)
    coarse_cos = (unit[:, :, :E].bfloat16() @ unit.transpose(-1, -2).bfloat16()).float()
    ties = coarse_cos.gather(-1, truth[..., None]) == coarse_cos.masked_fill(evicted[:, :, None, :], -2).amax(-1,
                                                                                                          keepdim=True)
    assert bool(ties.any())  # bfloat16 alone would not have found all of them


def test_dense_blocks_and_nonpositive_maxima_fall_back_to_float32_bit_for_bit(monkeypatch):
    """Near-duplicate keys (every cosine within the band: too many candidates) and rows whose
    maximum is not clearly positive (anti-correlated keys) are computed in float32: bit for bit the
    reference, with nothing re-scored."""
    spy = _Spy(monkeypatch)
    gen = torch.Generator().manual_seed(2)
    base = torch.randn(1, 2, 1, 64, generator=gen)
    dense = base + 1e-4 * torch.randn(1, 2, 200, 64, generator=gen)
    anti = torch.cat([base.expand(1, 2, 50, 64), -base.expand(1, 2, 150, 64)], 2) + 1e-3 * torch.randn(
        1, 2, 200, 64, generator=gen)
    for keys in (dense, anti):
        evicted = torch.zeros(1, 2, 200, dtype=torch.bool)
        evicted[..., :50] = True
        args = (keys, evicted, ~evicted, torch.zeros(1, 2, 200, dtype=torch.long))
        parent, best = most_similar_kept(*args, coarse=True)
        parent0, best0 = d2o_v2.most_similar_kept(*args)
        assert torch.equal(parent, parent0) and torch.equal(best, best0)
    assert spy.pairs == 0


def test_dense_block_switches_the_rest_to_float32(monkeypatch):
    """Evicted rows with few candidates first, then rows near a tight cluster of 40 receiving keys
    (40 candidates each): the first dense block and every later one go to the float32 search, the
    earlier ones stay coarse; the mixture is still the reference's result."""
    spy = _Spy(monkeypatch)
    calls = []
    real = d2o._coarse_candidates
    monkeypatch.setattr(d2o, "_coarse_candidates", lambda *a: calls.append(1) or real(*a))
    gen = torch.Generator().manual_seed(6)
    H, D = 2, 64
    base = torch.randn(1, H, 1, D, generator=gen)
    sparse = torch.randn(1, H, 100, D, generator=gen)
    tight = base + 1e-4 * torch.randn(1, H, 100, D, generator=gen)
    receivers = torch.cat([torch.randn(1, H, 100, D, generator=gen),
                           base + 1e-4 * torch.randn(1, H, 40, D, generator=gen)], 2)
    keys = torch.cat([sparse, tight, receivers], 2)
    evicted = torch.zeros(1, H, 340, dtype=torch.bool)
    evicted[..., :200] = True
    monkeypatch.setattr(d2o, "_COARSE_ENTRIES", H * 192 * 10)  # blocks of 10 rows (K = 140 -> 192 columns)
    _check((keys, evicted, ~evicted, torch.zeros(1, H, 340, dtype=torch.long)))
    assert spy.pairs > 0 and 5 <= len(calls) <= 11  # coarse up to the first dense block, then not tried again


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), D=st.sampled_from([1, 2, 8, 64, 128, 256]),
       kind=st.sampled_from(["random", "midpoints", "sparse", "spread"]))
def test_bfloat16_error_bound_holds(seed, D, kind):
    """|bfloat16 product - float32 product| <= coarse_error_bound(D) for unit float32 vectors,
    including adversarial ones: every component at a bfloat16 rounding midpoint with the same sign
    (the input roundings add up), one-hot/sparse ones, components spread over many binades."""
    gen = torch.Generator().manual_seed(seed)
    R = 64
    if kind == "random":
        a, b = torch.randn(R, D, generator=gen), torch.randn(R, D, generator=gen)
    elif kind == "midpoints":  # 1 + 2^-8 (+ a hair) rounds to 1 or 1 + 2^-7: the largest relative error
        m = 1 + 2.0 ** -8 + 2.0 ** -12 * torch.rand(R, D, generator=gen)
        a = m * torch.where(torch.rand(R, D, generator=gen) < 0.9, 1.0, -1.0)
        b = a * (1 + 2.0 ** -8 * torch.rand(R, D, generator=gen))
    elif kind == "sparse":
        a = torch.randn(R, D, generator=gen) * (torch.rand(R, D, generator=gen) < 0.2)
        b = torch.randn(R, D, generator=gen) * (torch.rand(R, D, generator=gen) < 0.2)
        a[:, 0] += 1e-3
        b[:, 0] += 1e-3
    else:
        a = torch.randn(R, D, generator=gen) * 2.0 ** torch.randint(-60, 20, (R, D), generator=gen)
        b = torch.randn(R, D, generator=gen) * 2.0 ** torch.randint(-60, 20, (R, D), generator=gen)
    a, b = F.normalize(a, dim=-1), F.normalize(b, dim=-1)
    exact32 = a @ b.T
    coarse = (a.bfloat16() @ b.bfloat16().T).float()
    assert float((coarse - exact32).abs().max()) <= coarse_error_bound(D)
    # batched, as the search computes it ([B, H, rows, D] x [B, H, D, K], the right side transposed)
    a3, b3 = a.view(1, 2, R // 2, D), b.view(1, 2, R // 2, D).repeat(1, 1, 9, 1)
    exact3 = a3 @ b3.transpose(-1, -2)
    coarse3 = (a3.bfloat16() @ b3.transpose(-1, -2).bfloat16()).float()
    assert float((coarse3 - exact3).abs().max()) <= coarse_error_bound(D)


def test_rescore_is_a_float32_dot_product():
    """The re-score against float64 (within float32 rounding of 64 terms) and, on a CPU whose BLAS
    sums in order with fused multiply-adds (checked here first), against torch.matmul bit for bit."""
    gen = torch.Generator().manual_seed(4)
    a = F.normalize(torch.randn(1, 3, 100, 64, generator=gen), dim=-1)
    b = F.normalize(torch.randn(1, 3, 70, 64, generator=gen), dim=-1)
    i = torch.randint(0, 100, (500,), generator=gen)
    j = torch.randint(0, 70, (500,), generator=gen)
    h = torch.randint(0, 3, (500,), generator=gen)
    got = d2o.rescore(a.transpose(-1, -2).contiguous(), h * 64 * 100 + i, b.transpose(-1, -2).contiguous(),
                      h * 64 * 70 + j)
    ref64 = (a[0, h, i].double() * b[0, h, j].double()).sum(-1)
    assert float((got.double() - ref64).abs().max()) <= 64 * 2.0 ** -24
    blas = (a @ b.transpose(-1, -2))[0, h, i, j]
    assert got.dtype == torch.float32
    assert float((got - blas).abs().max()) <= 2 * 64 * 2.0 ** -24


def test_coarse_is_the_default_only_where_bfloat16_is_fast():
    assert d2o.coarse_available(torch.device("cpu")) == torch.cpu._is_avx512_bf16_supported()
    assert not d2o.coarse_available(torch.device("meta"))


def test_rows_without_a_clearly_positive_maximum_take_every_unmasked_candidate(monkeypatch):
    """A few evicted keys point away from every receiving key (their best cosine is negative: the
    int16 block maxima do not order negative values) among ordinary rows: those rows re-score all
    their receiving slots, the block stays coarse, and the result is the reference's."""
    spy = _Spy(monkeypatch)
    gen = torch.Generator().manual_seed(8)
    B, H, N, D = 1, 2, 120, 64
    base = torch.randn(1, H, 1, D, generator=gen)
    keys = torch.randn(B, H, N, D, generator=gen) + base
    keys[:, :, :3] = -base + 0.1 * torch.randn(B, H, 3, D, generator=gen)  # anti-correlated evicted rows
    evicted = torch.zeros(B, H, N, dtype=torch.bool)
    evicted[..., :60] = True
    receiving = ~evicted
    receiving[..., -5:] = False  # and some padding columns
    chunk_ids = torch.zeros(B, H, N, dtype=torch.long)
    args = (keys, evicted, receiving, chunk_ids)
    parent, best = _check(args)
    assert bool((best[..., :3] < 0).all())  # the anti-correlated rows' best is negative
    assert spy.pairs >= 3 * H * 55


def test_default_path_small_searches_stay_float32(monkeypatch):
    """By default a search under 2^23 similarities (decode-time ones, small caches) runs in float32
    (bit for bit the float32 search); above it, the coarse search runs where bfloat16 is fast."""
    spy = _Spy(monkeypatch)
    args = _case(3, 200, 64, 1, False, False, 1.0)
    parent, best = most_similar_kept(*args)
    parent0, best0 = most_similar_kept(*args, coarse=False)
    assert torch.equal(parent, parent0) and torch.equal(best, best0) and spy.pairs == 0
    monkeypatch.setattr(d2o, "_COARSE_MIN_ENTRIES", 0)
    most_similar_kept(*args)
    assert (spy.pairs > 0) == d2o.coarse_available(torch.device("cpu"))
