"""Mergers: apply a merge plan to keys, values, sizes, positions and per-slot stats at once.

Size bookkeeping lives here only: SemantiCache's "mean" and CentroidKV's "degree" merger are the
same size-weighted mean (a slot standing for s tokens weighs s), so sizes/degrees accumulate across
rounds identically and proportional attention adds log(size) for both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..registry import register_merger
from ..types import NEG_INF, KVState
from ..validation import check_choice, require
from .scratch import scratch


def _flat_rows(x: Tensor) -> Tensor:
    """[B, H, N, *E] -> [B * H * N, prod(E)] (also when N == 0)."""
    return x.reshape(x.shape[0] * x.shape[1] * x.shape[2], math.prod(x.shape[3:]))


def _gathered(x: Tensor, index: Tensor, dtype: torch.dtype, name: str) -> Tensor:
    """``x.index_select(0, index).to(dtype)`` into the pooled buffer ``name`` (``scratch``): for the
    merges' intermediates, which never leave the call (a fresh [Q, D] tensor per merge costs its
    page faults, as much as the arithmetic)."""
    if x.dtype != dtype:
        return x.index_select(0, index).to(dtype)
    return torch.index_select(x, 0, index, out=scratch(name, (index.numel(), x.shape[1]), dtype, x.device))


def apply_merge_plan(state: KVState, parent: Tensor, weighting: str = "size") -> KVState:
    """Merge every slot into its parent; representatives keep their slot order.

    state:     keys/values [B, H, N, D], log_sizes [B, H, N]
    parent:    [B, H, N] long; parent[n] == n keeps slot n as a representative, another index
               merges slot n into that representative, -1 drops slot n
    weighting: "size" (members weigh by the tokens they stand for) or "uniform" (each slot
               weighs 1; an ablation). Sizes always add up exactly.
    returns    a state with M = max representatives per head slots; heads with fewer are padded
               with slots of log-size -inf, zero keys/values and position -1. Token counts
               (``state.counts`` when set) and every ``state.stats`` entry are summed over the
               members; ``state.extras`` is carried unchanged. A merged slot's bias (log_sizes)
               becomes log of its summed weight (proportional attention); singletons keep theirs.

    The mean is computed as rep + sum(w / sum(w) * (member - rep)): a singleton or a cluster of
    identical members comes out bit-for-bit equal to its representative. Work is done on flat
    rows (index_add / index_select of whole [D] rows), only for the slots that actually merge.
    """
    keys, values = state.keys, state.values
    B, H, N, D = keys.shape
    require(tuple(parent.shape) == (B, H, N), "parent", tuple(parent.shape), f"shape {(B, H, N)}")
    device = keys.device
    slot = torch.arange(N, device=device)
    kept = parent >= 0  # [B, H, N]
    safe_parent = parent.clamp(min=0)
    is_rep = parent == slot
    # a representative must keep itself, and a slot may only merge into a representative
    require(bool(is_rep.gather(-1, safe_parent).masked_fill(~kept, True).all()), "parent",
            "a plan whose target is not a representative", "parent[parent[n]] == parent[n]")

    out_index = is_rep.long().cumsum(-1) - 1  # [B, H, N] output slot of each representative
    M = int(out_index[..., -1].max()) + 1 if N else 0
    row_base = torch.arange(B * H, device=device)[:, None]  # [R, 1]
    # flat row index (into [R * M]) of every representative, and of every member merged into one
    rep_src = is_rep.reshape(-1).nonzero().squeeze(1)  # [K] into [R * N]
    rep_out = (row_base * M + out_index.reshape(B * H, N)).reshape(-1)[rep_src]  # [K]
    merged = kept & ~is_rep
    mem_src = merged.reshape(-1).nonzero().squeeze(1)  # [Q]
    mem_rep = (row_base * N + safe_parent.reshape(B * H, N)).reshape(-1)[mem_src]  # [Q] its representative
    mem_out = (row_base * M + out_index.reshape(B * H, N)).reshape(-1)[mem_rep]  # [Q]

    sizes = state.token_counts().reshape(-1)  # [R * N] float32 (0 for padding)
    if weighting == "size":
        w_rep, w_mem = sizes[rep_src], sizes[mem_src]
    else:
        w_rep = torch.ones(rep_src.numel(), device=device)
        w_mem = torch.ones(mem_src.numel(), device=device)
    sum_w = torch.zeros(B * H * M, device=device).index_copy_(0, rep_out, w_rep).index_add_(0, mem_out, w_mem)

    # each member moves its representative by w / sum(w) of their difference
    member_share = (w_mem / sum_w.index_select(0, mem_out))[:, None]  # [Q, 1]

    every_out_has_rep = rep_out.numel() == B * H * M  # then rep_out is 0..R*M-1 in order

    def mean_of(x: Tensor) -> Tensor:
        flat = _flat_rows(x)
        reps = flat.index_select(0, rep_src)  # [K, E]
        # without padding outputs the gather is the output already (no zero fill + scatter pass)
        out = reps if every_out_has_rep else flat.new_zeros(B * H * M, flat.shape[1]).index_copy_(0, rep_out, reps)
        if mem_src.numel() == 0:
            return out.view(B, H, M, *x.shape[3:])
        acc = out.to(torch.promote_types(x.dtype, torch.float32))  # the same tensor for float32
        delta = _gathered(flat, mem_src, acc.dtype, "merge.delta")  # [Q, E], updated in place
        delta.sub_(_gathered(acc, mem_out, acc.dtype, "merge.rep"))
        acc.index_add_(0, mem_out, delta.mul_(member_share))
        return acc.to(x.dtype).view(B, H, M, *x.shape[3:])

    new_keys = mean_of(keys)
    new_values = mean_of(values)

    def gather_reps(x: Tensor, fill) -> Tensor:
        # x: [B, H, N] -> the representatives' entries [B, H, M], `fill` where no representative
        out = torch.full((B * H * M,), fill, dtype=x.dtype, device=device)
        return out.index_copy_(0, rep_out, x.reshape(-1)[rep_src]).view(B, H, M)

    total = torch.zeros(B * H * M, device=device).index_copy_(0, rep_out, sizes[rep_src])
    total.index_add_(0, mem_out, sizes[mem_src])
    has_members = torch.zeros(B * H * M, dtype=torch.bool, device=device)
    has_members[mem_out] = True
    # singletons keep their log-size bit for bit; empty output slots stay -inf
    log_sizes = gather_reps(state.log_sizes, NEG_INF)
    log_sizes = torch.where(has_members.view(B, H, M), total.view(B, H, M).log(), log_sizes)

    positions = gather_reps(state.positions, -1)
    protected = None if state.protected is None else gather_reps(state.protected, False)

    counts = None
    if state.counts is not None:
        counts = total.view(B, H, M).clone()  # the counts were the weights' sizes: summed already

    stats = {}
    if state.stats:
        kept_src = kept.reshape(-1).nonzero().squeeze(1)
        kept_out = (row_base * M + out_index.reshape(B * H, N).gather(1, safe_parent.reshape(B * H, N)))
        kept_out = kept_out.reshape(-1)[kept_src]
        for name, x in state.stats.items():
            # per-slot statistics (e.g. accumulated attention) add up over members
            flat = _flat_rows(x)
            acc = flat.new_zeros(B * H * M, flat.shape[1]).index_add_(0, kept_out, flat.index_select(0, kept_src))
            stats[name] = acc.view(B, H, M, *x.shape[3:])
    return state.replace(keys=new_keys, values=new_values, log_sizes=log_sizes.contiguous(),
                         positions=positions, protected=protected, counts=counts, stats=stats)


def merge_in_place(state: KVState, parent: Tensor, weighting: str = "size") -> KVState:
    """``apply_merge_plan`` without the compaction, written into ``state``'s own tensors.

    state:  a working state whose tensors the caller owns (contiguous; the pipeline's rounds after
            the first one): keys/values [B, H, N, D], log_sizes [B, H, N]
    parent: [B, H, N] long, a plan as ``apply_merge_plan`` takes (invalid slots ignored)
    returns ``state`` (the same tensors): merged and dropped slots become padding where they stand
            (log-size -inf, position -1, not protected, count and stats 0; their keys and values
            are left as they were and are never read again), representatives that gained members
            take the size-weighted mean, the summed sizes and stats. Slots stay at N: ``compact``
            gathers the valid ones once after the last round.

    Per representative the arithmetic is ``apply_merge_plan``'s, term for term and in the same
    order (its members' deltas added in slot order), so rounds in place and one ``compact`` give
    the state that merging and compacting every round gives, for strategies that see slots only
    through ``valid`` and slot order; only the exp/log of the sizes may differ in the last bit (a
    vectorised and a scalar kernel round differently, depending on where a value sits in the
    tensor). Work: O(merged slots x D) for keys and values, instead of a copy of every slot per
    round: the protected slots (sinks, recent window, guards) are never copied again.
    """
    keys, values = state.keys, state.values
    B, H, N, D = keys.shape
    require(tuple(parent.shape) == (B, H, N), "parent", tuple(parent.shape), f"shape {(B, H, N)}")
    require(all(t.is_contiguous() for t in (keys, values, state.log_sizes, state.positions)), "state",
            "a state with non-contiguous tensors", "the contiguous working state of the pipeline's rounds")
    device = keys.device
    R = B * H
    slot = torch.arange(N, device=device)
    valid = state.valid
    kept = (parent >= 0) & valid
    safe_parent = parent.clamp(min=0)
    is_rep = (parent == slot) & valid
    require(bool(is_rep.gather(-1, safe_parent).masked_fill(~kept, True).all()), "parent",
            "a plan whose target is not a representative", "parent[parent[n]] == parent[n]")
    gone = (valid & ~is_rep).reshape(-1)  # merged or dropped: padding from now on
    if not bool(gone.any()):
        return state
    parent_flat = (torch.arange(R, device=device)[:, None] * N + safe_parent.reshape(R, N)).reshape(-1)
    mem_src = (kept & ~is_rep).reshape(-1).nonzero().squeeze(1)  # [Q] slot order
    mem_rep = parent_flat.index_select(0, mem_src)  # [Q]
    log_sizes = state.log_sizes.view(-1)
    counts = None if state.counts is None else state.counts.view(-1)
    if mem_src.numel():
        has = torch.zeros(R * N, dtype=torch.bool, device=device)
        has[mem_rep] = True
        targets = has.nonzero().squeeze(1)  # [U] representatives that gain members, slot order
        local = (has.long().cumsum(0) - 1)  # [R * N] row of each target in the [U] buffers
        mem_local = local.index_select(0, mem_rep)  # [Q]

        def weights(idx: Tensor) -> Tensor:
            return log_sizes.index_select(0, idx).exp() if counts is None else counts.index_select(0, idx)

        w_rep, w_mem = weights(targets), weights(mem_src)
        total = w_rep.clone().index_add_(0, mem_local, w_mem)  # [U] tokens each target stands for
        if weighting == "size":
            member_share = (w_mem / total.index_select(0, mem_local))[:, None]
        else:
            ones = torch.ones(mem_src.numel(), device=device)
            sum_w = torch.ones(targets.numel(), device=device).index_add_(0, mem_local, ones)
            member_share = (ones / sum_w.index_select(0, mem_local))[:, None]
        for x in (keys, values):
            flat = x.view(R * N, -1)
            acc = _gathered(flat, targets, torch.promote_types(x.dtype, torch.float32), "merge.acc")  # [U, E]
            delta = _gathered(flat, mem_src, acc.dtype, "merge.delta")
            delta.sub_(_gathered(acc, mem_local, acc.dtype, "merge.rep"))
            acc.index_add_(0, mem_local, delta.mul_(member_share))
            flat.index_copy_(0, targets, acc.to(x.dtype))
        log_sizes.index_copy_(0, targets, total.log())
        if counts is not None:
            counts.index_copy_(0, targets, total)
        if state.stats:
            # stats add up from zero over every kept slot of a target's cluster, in slot order
            into = kept.reshape(-1) & has.index_select(0, parent_flat)
            src = into.nonzero().squeeze(1)
            dst = local.index_select(0, parent_flat.index_select(0, src))
            for x in state.stats.values():
                flat = x.view(R * N, -1)
                acc = flat.new_zeros(targets.numel(), flat.shape[1]).index_add_(0, dst, flat.index_select(0, src))
                flat.index_copy_(0, targets, acc)
    log_sizes.masked_fill_(gone, NEG_INF)
    state.positions.view(-1).masked_fill_(gone, -1)
    if counts is not None:
        counts.masked_fill_(gone, 0.0)
    if state.protected is not None:
        state.protected.view(-1).masked_fill_(gone, False)
    for x in state.stats.values():
        x.view(R * N, -1).masked_fill_(gone[:, None], 0)
    return state


def compact(state: KVState) -> KVState:
    """The valid slots of ``state`` in slot order ([B, H, M], M = most valid slots of a head);
    heads with fewer are padded at the end (zero keys/values, log-size -inf, position -1, not
    protected, count and stats 0), as ``apply_merge_plan`` pads."""
    B, H, N, _ = state.keys.shape
    R = B * H
    device = state.keys.device
    valid = state.valid
    per_head = valid.sum(-1)
    M = int(per_head.max()) if N and R else 0
    src = valid.reshape(-1).nonzero().squeeze(1)
    dst = (torch.arange(R, device=device)[:, None] * M + valid.long().cumsum(-1).reshape(R, N) - 1).reshape(-1)
    dst = dst.index_select(0, src)
    dense = src.numel() == R * M  # no padding: the gather is the result

    def rows(x: Tensor, fill) -> Tensor:
        flat = _flat_rows(x)
        got = flat.index_select(0, src)
        if not dense:
            got = flat.new_full((R * M, flat.shape[1]), fill).index_copy_(0, dst, got)
        return got.view(B, H, M, *x.shape[3:])

    return state.replace(
        keys=rows(state.keys, 0), values=rows(state.values, 0), log_sizes=rows(state.log_sizes, NEG_INF),
        positions=rows(state.positions, -1),
        protected=None if state.protected is None else rows(state.protected, False),
        counts=None if state.counts is None else rows(state.counts, 0.0),
        stats={k: rows(x, 0) for k, x in state.stats.items()})


def is_identity_plan(state: KVState, parent: Tensor) -> bool:
    """True when the plan keeps every valid slot as it is and there is no padding to drop."""
    slot = torch.arange(state.num_slots, device=parent.device)
    return bool((parent == slot).all())


@register_merger("mean")
@dataclass(frozen=True)
class MeanMerger:
    """SemantiCache's semantic core: size-weighted mean of keys and of values; sizes add up.

    weighting: "size" (default, faithful) or "uniform" (every slot weighs 1: ablation)
    """

    weighting: str = "size"

    def __post_init__(self):
        check_choice("weighting", self.weighting, ("size", "uniform"))

    def __call__(self, state: KVState, parent: Tensor) -> KVState:
        """A plan that changes anything gives fresh tensors (``MergesInPlace``: the pipeline then
        runs its later rounds in place on them)."""
        if is_identity_plan(state, parent):
            return state
        return apply_merge_plan(state, parent, self.weighting)

    def merge_in_place(self, work: KVState, parent: Tensor) -> KVState:
        return merge_in_place(work, parent, self.weighting)

    def compact(self, work: KVState) -> KVState:
        return compact(work)


@register_merger("degree")
@dataclass(frozen=True)
class DegreeWeightedMerger(MeanMerger):
    """CentroidKV's centroid: degree-weighted mean; the degree is the slot size (shared code)."""
