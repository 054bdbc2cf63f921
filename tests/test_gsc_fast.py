"""The vectorised GSC against its previous implementation (tests/slow_reference/gsc_v0.py, kept
verbatim as a slow reference): the plans, the searched thresholds and the seeds must be
bit-identical, on random cases and on long chunks (several bitset words)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from conftest import CORE_SETTINGS, random_keys
from kvcompress.strategies import gsc as fast
from kvcompress.strategies.segments import build_segments
from kvcompress.types import KVState
from slow_reference import gsc_v0 as slow


def _case(seed, B, H, N, D, num_chunks, p_out, p_invalid, duplicates):
    gen = torch.Generator().manual_seed(seed)
    keys = random_keys(gen, B, H, N, D)
    if duplicates and N > 1:  # identical keys: cosines tie exactly with each other and with 1
        keys[..., 1::2, :] = keys[..., ::2, :][..., : keys[..., 1::2, :].shape[-2], :]
    values = torch.randn(B, H, N, D, generator=gen)
    chunk = torch.randint(0, num_chunks, (B, H, N), generator=gen)
    out = torch.rand(B, H, N, generator=gen) < p_out
    invalid = torch.rand(B, H, N, generator=gen) < p_invalid
    chunk = torch.where(out | invalid, -1, chunk)
    log_sizes = torch.zeros(B, H, N).masked_fill(invalid, float("-inf"))
    positions = torch.arange(N).expand(B, H, N).masked_fill(invalid, -1)
    state = KVState(keys=keys, values=values, log_sizes=log_sizes, positions=positions, num_tokens=N)
    return state, chunk


def _both(state, chunk, target, **params):
    new = fast.GreedySeedClustering(**params)(state, chunk, target, 0)
    old = slow.GreedySeedClustering(**params)(state, chunk, target, 0)
    return new, old


@CORE_SETTINGS
@given(seed=st.integers(0, 2**31 - 1), B=st.integers(1, 2), H=st.integers(1, 3), N=st.integers(1, 150),
       D=st.integers(1, 8), num_chunks=st.integers(1, 4), p_out=st.sampled_from([0.0, 0.2]),
       p_invalid=st.sampled_from([0.0, 0.1]), duplicates=st.booleans(), keep=st.floats(0.05, 1.0),
       tau=st.one_of(st.none(), st.floats(-1.0, 1.0)), dense=st.booleans())
def test_plans_are_bit_identical_to_the_previous_implementation(seed, B, H, N, D, num_chunks, p_out, p_invalid,
                                                                duplicates, keep, tau, dense):
    state, chunk = _case(seed, B, H, N, D, num_chunks, p_out, p_invalid, duplicates)
    target = torch.floor(state.valid.sum(-1).double() * keep).long().clamp(min=1)
    new, old = _both(state, chunk, target, tau=tau, dense_limit=(1 << 26) if dense else 1)
    assert torch.equal(new.parent, old.parent)
    assert torch.equal(new.tau, old.tau)


@pytest.mark.parametrize("length", [64, 200, 700])
def test_long_chunks_bit_identical(length):
    state, chunk = _case(3, 1, 2, length, 16, 1, 0.0, 0.05, False)
    target = torch.full((1, 2), length // 4, dtype=torch.long)
    new, old = _both(state, chunk, target)
    assert torch.equal(new.parent, old.parent) and torch.equal(new.tau, old.tau)


@CORE_SETTINGS
@given(seed=st.integers(0, 2**31 - 1), L=st.integers(2, 130), S=st.integers(1, 4), C=st.integers(1, 6),
       shuffled=st.booleans())
def test_spared_words_equal_a_comparison_per_threshold(seed, L, S, C, shuffled):
    """The searched words against the direct definition: member j is spared by row i at
    threshold c unless j is a later real member with cos(i, j) > tau[s, c]; thresholds in any order."""
    gen = torch.Generator().manual_seed(seed)
    N = S * L
    keys = random_keys(gen, 1, 1, N, 4).reshape(N, 4)
    kn = F.normalize(keys, dim=-1)
    chunk = (torch.arange(N) // L)[None]
    drop = torch.rand(1, N, generator=gen) < 0.1
    layout = build_segments(torch.where(drop, -1, chunk), min_length=2)
    taus = torch.rand(S * 8, C, generator=gen) * 2 - 1
    if not shuffled:
        taus = taus.sort(1).values
    for bucket in layout.buckets:
        sims = fast.BucketSimilarity(kn, bucket, N, 1 << 26)
        tau = taus[: bucket.mask.shape[0]]
        blocks = sims.spared(tau)
        words = torch.cat([w for _, w in blocks])  # [L', S', C, W]
        width, _, _ = sims.words
        Lb = bucket.mask.shape[1]
        bits = fast._unpack(words, width, Lb)  # [L', S', C, Lb]
        absorbed = sims.dense[:, :, None, :] > tau[None, :, :, None]
        assert torch.equal(bits[:Lb - 1], ~absorbed[:Lb - 1])


@CORE_SETTINGS
@given(seed=st.integers(0, 2**31 - 1), b=st.integers(1, 4), S=st.integers(1, 5), L=st.integers(1, 40),
       C=st.integers(1, 70), width=st.sampled_from([2.0, 0.1, 0.001]), ties=st.booleans())
def test_count_below_equals_searchsorted(seed, b, S, L, C, width, ties):
    """Both branches (comparisons, and the search of the few values inside a narrow bracket) and
    the binary search for many thresholds give searchsorted's slot, ties at thresholds included."""
    gen = torch.Generator().manual_seed(seed)
    centre = torch.rand(S, 1, generator=gen) - 0.5
    tau = (centre + (torch.rand(S, C, generator=gen) - 0.5) * width).sort(1).values
    vals = torch.rand(b, S, L, generator=gen) * 2 - 1
    if ties:  # values exactly at thresholds
        vals[..., ::2] = tau[None, :, :1].expand(b, S, 1)
        vals[..., 1::3] = tau[None, :, -1:].expand(b, S, 1)
    vals[0, 0, 0] = fast._EXCLUDED
    want = torch.searchsorted(tau[None].expand(b, S, C).contiguous(), vals)
    assert torch.equal(fast._count_below(vals, tau).long(), want)


@pytest.mark.parametrize("spread, keep, evaluations", [(0.05, 0.5, 3), (3.0, 0.05, 4)])
def test_first_pass_top_third_then_the_rest(monkeypatch, spread, keep, evaluations):
    """The first search pass counts its top third of candidates and the rest only when some head
    found none feasible there: both ways (close keys: the top third suffices, 3 passes = 3 counts;
    spread keys at a low keep: the rest is counted too, 4) the plan and tau are the old ones."""
    gen = torch.Generator().manual_seed(5)
    B, H, N, D = 1, 2, 192, 16
    protos = torch.randn(B, H, 4, D, generator=gen)
    keys = protos.repeat_interleave(N // 4, 2) + spread * torch.randn(B, H, N, D, generator=gen)
    state = KVState.from_raw(keys, torch.randn(B, H, N, D, generator=gen))
    chunk = (torch.arange(N) // 32).expand(B, H, N).clone()
    target = torch.full((B, H), int(N * keep), dtype=torch.long)
    calls = []
    real = fast.GreedySeedClustering._counts
    monkeypatch.setattr(fast.GreedySeedClustering, "_counts",
                        staticmethod(lambda *a: calls.append(a[-1].shape[0]) or real(*a)))
    new, old = _both(state, chunk, target)
    assert len(calls) == evaluations
    assert torch.equal(new.parent, old.parent) and torch.equal(new.tau, old.tau)
