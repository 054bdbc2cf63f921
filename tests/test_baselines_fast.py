"""The merging baselines' fast paths (issue 16) against their slow versions in tests/slow_reference,
on random caches with several chunk layouts, padding heads, merged slots and duplicate keys.

D2O's search multiplies a gathered block of rows instead of slicing the whole matrix, so the BLAS
may round a cosine differently in the last bit: the parents are the same except where two
receiving slots are within 1e-6 of each other (then either is the most similar), and the
similarities agree to 1e-6. The window attention is the same bit for bit."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompress.strategies.d2o import most_similar_kept
from slow_reference.d2o_v0 import most_similar_kept as most_similar_kept_v0


def _case(seed: int, N: int, chunks: int, dup: bool, uneven: bool):
    gen = torch.Generator().manual_seed(seed)
    B, H, D = 2, 3, 8
    keys = torch.randn(B, H, N, D, generator=gen)
    if dup:  # exact duplicates: ties between receiving slots
        keys[:, :, 1::3] = keys[:, :, 0:N - 1:3][:, :, : keys[:, :, 1::3].shape[2]]
    chunk_ids = (torch.arange(N) * chunks // N).expand(B, H, N).clone()
    chunk_ids[:, :, :2] = -1  # sinks: in no chunk
    free = chunk_ids >= 0
    keep = torch.rand(B, H, N, generator=gen) < 0.3
    if uneven:  # one head keeps nothing, another evicts nothing
        keep[0, 1] = False
        keep[1, 2] = True
    return keys, free & ~keep, free & keep, chunk_ids


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), N=st.integers(3, 80), chunks=st.sampled_from([1, 2, 5]),
       dup=st.booleans(), uneven=st.booleans())
def test_d2o_nearest_kept_is_the_slow_version(seed, N, chunks, dup, uneven):
    _check_against_v0(_case(seed, N, chunks, dup, uneven))


def _check_against_v0(args):
    keys = args[0]
    parent, best = most_similar_kept(*args)
    parent0, best0 = most_similar_kept_v0(*args)
    assert torch.equal(parent >= 0, parent0 >= 0)
    assert torch.equal(best == float("-inf"), best0 == float("-inf"))
    torch.testing.assert_close(best, best0, atol=1e-6, rtol=0)
    unit = torch.nn.functional.normalize(keys.double(), dim=-1)
    has = parent0 >= 0

    def cos(p):
        return (unit * unit.gather(2, p.clamp(min=0)[..., None].expand_as(unit))).sum(-1)

    # a different parent only at a near tie: the chosen slot is as similar as the reference's
    differs = has & (parent != parent0)
    assert bool(((cos(parent) - cos(parent0)).abs()[differs] <= 1e-6).all())
    assert int(differs.sum()) <= max(1, int(has.sum()) // 20)


@pytest.mark.parametrize("chunks", [1, 3])
def test_d2o_nearest_kept_over_several_row_blocks(chunks, monkeypatch):
    import kvcompress.strategies.d2o as d2o

    monkeypatch.setattr(d2o, "_ROW_BLOCK", 16)
    args = _case(3, 200, chunks, True, False)
    _check_against_v0(args)
    assert bool((most_similar_kept(*args)[0] >= 0).any())


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), K=st.integers(1, 700), levels=st.sampled_from([0, 2, 5]),
       masked=st.booleans())
def test_row_max_is_max_with_the_first_index(seed, K, levels, masked):
    """The blocked max against ``max(-1)``: equal values and the first index of the maximum, with
    ties (few distinct values), rows that are all -inf (masked chunks) and a partial last block."""
    from kvcompress.strategies.d2o import row_max

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 5, K, generator=gen)
    if levels:
        x = torch.randint(0, levels, x.shape, generator=gen).float()
    if masked:
        x[0, 1] = float("-inf")
        x[1, :, :, : K // 2] = float("-inf")
    val, idx = row_max(x)
    want_val, want_idx = x.max(-1)
    assert torch.equal(val, want_val) and torch.equal(idx, want_idx)


# ------------------------------------------------------------------ window attention (CaM, H2O, SnapKV)
from kvcompress import KVState  # noqa: E402
from kvcompress.strategies.mergers import apply_merge_plan  # noqa: E402
from kvcompress.strategies.scorers import window_attention  # noqa: E402
from slow_reference.scorers_v0 import window_attention as window_attention_v0  # noqa: E402


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), N=st.integers(2, 40), W=st.integers(1, 6), merge=st.booleans(),
       pad=st.integers(0, 3), proportional=st.booleans(), reduce=st.sampled_from(["sum", "mean"]))
def test_window_attention_is_the_slow_version_bit_for_bit(seed, N, W, merge, pad, proportional, reduce):
    gen = torch.Generator().manual_seed(seed)
    B, H, G, D = 2, 2, 2, 4
    mask = torch.ones(B, N)
    mask[1, :min(pad, N - 1)] = 0
    state = KVState.from_raw(torch.randn(B, H, N, D, generator=gen), torch.randn(B, H, N, D, generator=gen),
                             attention_mask=mask)
    if merge:  # merged slots: sizes, representatives' positions, padding heads
        rep = torch.rand(B, H, N, generator=gen) < 0.6
        rep[..., 0] = True
        rep[0, 1, N // 3] = True
        parent = torch.where(rep, torch.arange(N), 0).cummax(-1).values  # into the last representative
        parent[0, 1, : N // 3] = -1  # dropped: a head with fewer slots (padding after the merge)
        state = apply_merge_plan(state, parent)
    q = torch.randn(B, H * G, min(W, N), D, generator=gen)
    got = window_attention(state, q, None, proportional, reduce)
    ref = window_attention_v0(state, q, None, proportional, reduce)
    assert torch.equal(got, ref)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), N=st.integers(3, 80), chunks=st.sampled_from([1, 2]),
       dup=st.booleans(), uneven=st.booleans(), row_block=st.sampled_from([7, 1024]))
def test_d2o_nearest_kept_is_the_previous_version_bit_for_bit(seed, N, chunks, dup, uneven, row_block):
    """The padding-only mask (one chunk per head, heads with different numbers of receiving
    slots) against the version that masked every block whole (tests/slow_reference/d2o_v1.py)."""
    import kvcompress.strategies.d2o as d2o
    from slow_reference import d2o_v1

    args = _case(seed, N, chunks, dup, uneven)
    old_block = d2o._ROW_BLOCK
    d2o._ROW_BLOCK = d2o_v1._ROW_BLOCK = row_block
    try:
        parent, best = most_similar_kept(*args, coarse=False)  # the float32 search (tests/test_d2o_coarse.py: the other)
        parent1, best1 = d2o_v1.most_similar_kept(*args)
    finally:
        d2o._ROW_BLOCK = d2o_v1._ROW_BLOCK = old_block
    assert torch.equal(parent, parent1) and torch.equal(best, best1)
