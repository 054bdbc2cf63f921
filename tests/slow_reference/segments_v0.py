"""The previous build_segments (sorting every row), kept verbatim as the slow reference of
tests/test_segments_fast.py.

Chunk ids -> padded segment layouts, so clusterers can run over all chunks of all heads at once.

A *segment* is the set of slots of one chunk in one (batch, head) row, in slot order (chunks need
not be contiguous: protected slots may sit inside them). Segments are grouped into buckets of
similar length (lengths in (L/2, L], L a power of two) and padded to L, which bounds the padding
waste to 2x however skewed the chunk lengths are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Bucket:
    """Segments of length in (L/2, L], padded to L.

    slots: [S, L] long  slot index inside the row (0 where padded)
    rows:  [S]    long  flattened (batch * heads) row of each segment
    mask:  [S, L] bool  real members
    """

    slots: Tensor
    rows: Tensor
    mask: Tensor

    @property
    def length(self) -> int:
        return self.slots.shape[1]

    def flat_index(self, num_slots: int) -> Tensor:
        """[S, L] index into a [rows * N] flattening."""
        return self.rows[:, None] * num_slots + self.slots


@dataclass(frozen=True)
class SegmentLayout:
    buckets: tuple[Bucket, ...]
    num_rows: int
    num_slots: int
    segments_per_row: Tensor  # [R] long
    members_per_row: Tensor  # [R] long, slots inside some chunk


def build_segments(chunk_ids: Tensor, min_length: int = 1) -> SegmentLayout:
    """chunk_ids: [R, N] long (-1 = not in a chunk) -> buckets of padded segments.

    Segments shorter than ``min_length`` are counted but not put into buckets (a segment of one
    slot has nothing to cluster).
    """
    R, N = chunk_ids.shape
    device = chunk_ids.device
    inside = chunk_ids >= 0
    big = torch.iinfo(torch.long).max
    key = torch.where(inside, chunk_ids, torch.full_like(chunk_ids, big))
    # stable: slots of one chunk stay in slot order
    sorted_key, order = torch.sort(key, dim=1, stable=True)  # [R, N]
    sorted_inside = sorted_key != big
    change = torch.ones_like(sorted_inside)
    change[:, 1:] = sorted_key[:, 1:] != sorted_key[:, :-1]
    starts = (sorted_inside & change).flatten()  # [R*N]
    seg_of = starts.long().cumsum(0) - 1  # segment id per sorted entry
    flat_inside = sorted_inside.flatten()
    start_flat = starts.nonzero().squeeze(1)  # [G]
    num_segments = start_flat.numel()
    lengths = torch.bincount(seg_of[flat_inside], minlength=num_segments)[:num_segments]  # [G]
    seg_rows = torch.div(start_flat, N, rounding_mode="floor")
    segments_per_row = torch.bincount(seg_rows, minlength=R)
    members_per_row = inside.sum(1)

    buckets = []
    if num_segments:
        flat_order = order.flatten()
        max_len = int(lengths.max())
        L = 1
        while True:
            lo = L // 2
            pick = (lengths > lo) & (lengths <= L) & (lengths >= min_length)
            if bool(pick.any()):
                s = start_flat[pick]
                n = lengths[pick]
                ar = torch.arange(L, device=device)
                mask = ar[None, :] < n[:, None]  # [S, L]
                idx = (s[:, None] + ar[None, :]).clamp(max=R * N - 1)
                slots = torch.where(mask, flat_order[idx], 0)
                buckets.append(Bucket(slots=slots, rows=seg_rows[pick], mask=mask))
            if L >= max_len:
                break
            L *= 2
    return SegmentLayout(tuple(buckets), R, N, segments_per_row, members_per_row)
