"""Chunk ids -> padded segment layouts, so clusterers can run over all chunks of all heads at once.

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
    # chunkers give ids non-decreasing along N among the clustered slots (the Chunker contract):
    # the stable sort is then a stable partition, clustered slots first, each part in slot order,
    # which prefix counts give without sorting; any other input falls back to the sort
    ins = inside.long()
    rank_in = ins.cumsum(1)
    dest = torch.where(inside, rank_in - 1, rank_in[:, -1:] + torch.arange(N, device=device) - rank_in)
    order = torch.empty_like(dest).scatter_(1, dest, torch.arange(N, device=device).expand(R, N))
    sorted_key = key.gather(1, order)
    if not bool((sorted_key[:, 1:] >= sorted_key[:, :-1]).all()):
        sorted_key, order = torch.sort(key, dim=1, stable=True)  # [R, N], stable: slot order kept
    sorted_inside = sorted_key != big
    change = torch.ones_like(sorted_inside)
    change[:, 1:] = sorted_key[:, 1:] != sorted_key[:, :-1]
    start_flat = (sorted_inside & change).flatten().nonzero().squeeze(1)  # [G]
    num_segments = start_flat.numel()
    members_per_row = inside.sum(1)
    seg_rows = torch.div(start_flat, N, rounding_mode="floor")
    segments_per_row = torch.bincount(seg_rows, minlength=R)
    # a row's clustered slots lead its sorted entries: a segment ends at the next one's start or
    # at the end of its row's clustered slots (differences, not a bincount over every entry)
    ends = torch.cat([start_flat[1:], start_flat.new_full((1,), R * N)])
    lengths = torch.minimum(ends, seg_rows * N + members_per_row.index_select(0, seg_rows)) - start_flat  # [G]

    buckets = []
    if num_segments:
        flat_order = order.flatten()
        # bucket of each segment: L = the least power of two >= its length (lengths in (L/2, L]),
        # found for all segments at once; only the buckets present are built, shortest first
        top = max(int(lengths.max()), 1).bit_length()
        powers = torch.tensor([1 << k for k in range(top + 1)], device=device)
        level = (lengths[:, None] > powers[None, :]).sum(1)  # [G]
        level = torch.where(lengths >= min_length, level, -1)
        for lev in torch.unique(level).tolist():
            if lev < 0:
                continue
            L = 1 << lev
            pick = (level == lev).nonzero().squeeze(1)
            s = start_flat.index_select(0, pick)
            n = lengths.index_select(0, pick)
            ar = torch.arange(L, device=device)
            mask = ar[None, :] < n[:, None]  # [S, L]
            idx = (s[:, None] + ar[None, :]).clamp_(max=R * N - 1)
            slots = flat_order.index_select(0, idx.view(-1)).view(idx.shape).masked_fill_(~mask, 0)
            buckets.append(Bucket(slots=slots, rows=seg_rows.index_select(0, pick), mask=mask))
    return SegmentLayout(tuple(buckets), R, N, segments_per_row, members_per_row)
