"""Where an evicted slot may go: the kept slots next to it that may receive merges.

Shared by the merging baselines (CaM, D2O). Slots are looked at in "kept order" (the kept slots of
a head, in slot order); a *run* is a maximal stretch of kept slots that are clusterable and of the
same chunk. A kept slot that is protected or an anchor has a label of its own, so it ends every run:
merges never reach protected slots and never cross chunks, as the pipeline requires.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class KeptOrder:
    """The kept slots of each head in slot order, padded to K.

    slot:      [B, H, K] long  slot index of the k-th kept slot (N for padding)
    label:     [B, H, K] long  chunk id of a receiving slot, a unique negative label otherwise
    run_start: [B, H, K] long  first kept-order index of the run holding k
    run_end:   [B, H, K] long  last kept-order index of the run holding k
    before:    [B, H, N] long  kept slots with a smaller slot index than n
    count:     [B, H]    long  kept slots per head
    """

    slot: Tensor
    label: Tensor
    run_start: Tensor
    run_end: Tensor
    before: Tensor
    count: Tensor


def kept_order(kept: Tensor, receiving: Tensor, chunk_ids: Tensor) -> KeptOrder:
    """kept: [B, H, N] bool slots that stay; receiving: [B, H, N] bool kept slots that may absorb
    evicted ones (clusterable); chunk_ids: [B, H, N] long."""
    B, H, N = kept.shape
    device = kept.device
    count = kept.sum(-1)
    K = max(1, int(count.max()))
    k_idx = kept.long().cumsum(-1) - 1  # [B, H, N]
    before = k_idx + 1 - kept.long()  # kept slots strictly before n
    dest = torch.where(kept, k_idx, K)  # non-kept slots scatter into a trash column
    slot_ar = torch.arange(N, device=device).expand(B, H, N)
    slot = torch.full((B, H, K + 1), N, dtype=torch.long, device=device).scatter_(-1, dest, slot_ar)[..., :K]
    own = -2 - slot_ar  # a label no chunk id can equal
    lab = torch.where(receiving, chunk_ids, own)
    pad_label = -2 - N - torch.arange(K + 1, device=device).expand(B, H, K + 1)
    label = pad_label.clone().scatter_(-1, dest, lab)[..., :K]

    k_ar = torch.arange(K, device=device).expand(B, H, K)
    last = torch.ones(B, H, K, dtype=torch.bool, device=device)
    last[..., :-1] = label[..., 1:] != label[..., :-1]
    first = torch.ones_like(last)
    first[..., 1:] = label[..., 1:] != label[..., :-1]
    big = torch.full_like(k_ar, K)
    run_end = torch.where(last, k_ar, big).flip(-1).cummin(-1).values.flip(-1)
    run_start = torch.where(first, k_ar, torch.full_like(k_ar, -1)).cummax(-1).values
    return KeptOrder(slot, label, run_start, run_end, before, count)


def span_targets(order: KeptOrder, evicted: Tensor, chunk_ids: Tensor, span: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """For every evicted slot, the up to ``span`` nearest receiving slots of its chunk, taken
    from the run that starts right after it (or, if there is none, the run that ends right
    before it), never crossing a protected slot or an anchor.

    returns (first, last, ok, after): [B, H, N] long kept-order indices of the span [first, last],
            [B, H, N] bool whether the slot has one (False also for slots that are not evicted)
            and [B, H, N] bool whether the span lies after the slot
    """
    K = order.slot.shape[-1]
    c = order.before  # [B, H, N]
    k_after = c.clamp(max=K - 1)
    k_before = (c - 1).clamp(min=0)
    lab_after = order.label.gather(-1, k_after)
    lab_before = order.label.gather(-1, k_before)
    ok_after = evicted & (c < order.count[..., None]) & (lab_after == chunk_ids)
    ok_before = evicted & (c >= 1) & (lab_before == chunk_ids) & ~ok_after
    first = torch.where(ok_after, k_after,
                        torch.maximum(k_before - span + 1, order.run_start.gather(-1, k_before)))
    last = torch.where(ok_after, torch.minimum(k_after + span - 1, order.run_end.gather(-1, k_after)),
                       k_before)
    return first, last, ok_after | ok_before, ok_after


def span_parent(order: KeptOrder, first: Tensor, last: Tensor, ok: Tensor, after: Tensor) -> Tensor:
    """Encode a span in a merge plan: the parent is the span's far end (the slot furthest from the
    evicted slot), so the span is every representative between the evicted slot and its parent.
    after: [B, H, N] bool, the span lies after the slot. Returns [B, H, N] long, -1 if not ok."""
    far = torch.where(after, last, first)
    return torch.where(ok, order.slot.gather(-1, far.clamp(min=0)), -1)
