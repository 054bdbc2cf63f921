"""Mergers: apply a merge plan to keys, values, sizes, positions and per-slot extras at once.

Size bookkeeping lives here only: SemantiCache's "mean" and CentroidKV's "degree" merger are the
same size-weighted mean (a slot standing for s tokens weighs s), so sizes/degrees accumulate across
rounds identically and proportional attention adds log(size) for both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..registry import register_merger
from ..types import NEG_INF, KVState
from ..validation import check_choice, require


def apply_merge_plan(state: KVState, parent: Tensor, weighting: str = "size") -> KVState:
    """Merge every slot into its parent; representatives keep their slot order.

    state:     keys/values [B, H, N, D], log_sizes [B, H, N]
    parent:    [B, H, N] long; parent[n] == n keeps slot n as a representative, another index
               merges slot n into that representative, -1 drops slot n
    weighting: "size" (members weigh by the tokens they stand for) or "uniform" (each slot
               weighs 1; an ablation). Sizes always add up exactly.
    returns    a state with M = max representatives per head slots; heads with fewer are padded
               with slots of log-size -inf, zero keys/values and position -1.

    The mean is computed as rep + sum(w * (member - rep)) / sum(w): a singleton or a cluster of
    identical members comes out bit-for-bit equal to its representative.
    """
    keys, values = state.keys, state.values
    B, H, N, D = keys.shape
    require(tuple(parent.shape) == (B, H, N), "parent", tuple(parent.shape), f"shape {(B, H, N)}")
    slot = torch.arange(N, device=keys.device)
    kept = parent >= 0  # [B, H, N]
    safe_parent = parent.clamp(min=0)
    is_rep = parent == slot
    # a representative must keep itself, and a slot may only merge into a representative
    require(bool(is_rep.gather(-1, safe_parent).masked_fill(~kept, True).all()), "parent",
            "a plan whose target is not a representative", "parent[parent[n]] == parent[n]")

    out_index = is_rep.long().cumsum(-1) - 1  # [B, H, N] output slot of each representative
    M = int(is_rep.sum(-1).max()) if N else 0
    trash = M  # dropped slots scatter into one extra slot that is sliced away
    dest = torch.where(kept, out_index.gather(-1, safe_parent), torch.full_like(parent, trash))

    sizes = state.log_sizes.exp().masked_fill(~kept, 0.0)  # [B, H, N] float32
    weights = sizes if weighting == "size" else kept.float()
    rep_dest = torch.where(is_rep, out_index, torch.full_like(parent, trash))

    def scatter_rows(x: Tensor, index: Tensor, reduce_add: bool) -> Tensor:
        # x: [B, H, N, *E] -> [B, H, M + 1, *E]
        extra = x.shape[3:]
        idx = index.view(B, H, N, *([1] * len(extra))).expand_as(x)
        out = x.new_zeros(B, H, M + 1, *extra)
        return out.scatter_add_(2, idx, x) if reduce_add else out.scatter_(2, idx, x)

    sum_w = scatter_rows(weights, dest, True)  # [B, H, M+1]
    members = scatter_rows(kept.float(), dest, True)  # [B, H, M+1]
    singleton = members <= 1

    def mean_of(x: Tensor) -> Tensor:
        rep_x = x.gather(2, safe_parent[..., None].expand_as(x))  # the representative's row per slot
        delta = (x.float() - rep_x.float()) * weights[..., None]
        shift = scatter_rows(delta, dest, True) / sum_w.clamp(min=1e-30)[..., None]
        base = scatter_rows(x, rep_dest, False)
        return (base.float() + shift).to(x.dtype)

    new_keys = mean_of(keys)[:, :, :M]
    new_values = mean_of(values)[:, :, :M]

    total = scatter_rows(sizes, dest, True)
    rep_log = scatter_rows(state.log_sizes.masked_fill(~kept, 0.0), rep_dest, False)
    log_sizes = torch.where(singleton, rep_log, total.clamp(min=1e-30).log())
    occupied = scatter_rows(is_rep.float(), rep_dest, True) > 0
    log_sizes = log_sizes.masked_fill(~occupied, NEG_INF)[:, :, :M]

    positions = scatter_rows(state.positions + 1, rep_dest, False)[:, :, :M] - 1  # 0 -> -1 for padding
    protected = None
    if state.protected is not None:
        protected = scatter_rows(state.protected, rep_dest, False)[:, :, :M]

    extras = {}
    for name, x in state.extras.items():
        if isinstance(x, Tensor) and tuple(x.shape[:3]) == (B, H, N):
            # per-slot statistics (e.g. accumulated attention) add up over members
            extras[name] = scatter_rows(x.masked_fill(~kept.view(B, H, N, *([1] * (x.dim() - 3))), 0),
                                        dest, True)[:, :, :M]
        else:
            extras[name] = x
    return state.replace(keys=new_keys, values=new_values, log_sizes=log_sizes.contiguous(),
                         positions=positions, protected=protected, extras=extras)


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
        if is_identity_plan(state, parent):
            return state
        return apply_merge_plan(state, parent, self.weighting)


@register_merger("degree")
@dataclass(frozen=True)
class DegreeWeightedMerger(MeanMerger):
    """CentroidKV's centroid: degree-weighted mean; the degree is the slot size (shared code)."""
