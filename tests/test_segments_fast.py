"""build_segments without the sort (chunk ids non-decreasing among the clustered slots, the
Chunker contract) against its previous implementation (tests/slow_reference/segments_v0.py): the
same buckets, bit for bit, on monotone ids and on ids that are not (which fall back to the sort)."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from conftest import CORE_SETTINGS
from kvcompress.strategies.segments import build_segments
from slow_reference import segments_v0 as slow


def _same(a, b):
    assert len(a.buckets) == len(b.buckets)
    for x, y in zip(a.buckets, b.buckets):
        assert torch.equal(x.slots, y.slots) and torch.equal(x.rows, y.rows) and torch.equal(x.mask, y.mask)
    assert torch.equal(a.segments_per_row, b.segments_per_row)
    assert torch.equal(a.members_per_row, b.members_per_row)
    assert (a.num_rows, a.num_slots) == (b.num_rows, b.num_slots)


@CORE_SETTINGS
@given(seed=st.integers(0, 2**31 - 1), R=st.integers(1, 4), N=st.integers(1, 200), chunks=st.integers(1, 12),
       p_out=st.sampled_from([0.0, 0.1, 0.5, 1.0]), monotone=st.booleans(), min_length=st.integers(1, 3))
def test_build_segments_equals_the_sorting_version(seed, R, N, chunks, p_out, monotone, min_length):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, chunks, (R, N), generator=gen)
    if monotone:
        ids = ids.sort(1).values
    ids = torch.where(torch.rand(R, N, generator=gen) < p_out, -1, ids)
    _same(build_segments(ids, min_length), slow.build_segments(ids, min_length))
