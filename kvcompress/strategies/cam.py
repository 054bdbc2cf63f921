"""CaM, Cache Merging (Zhang et al., ICML 2024): evicted tokens' values are merged into the kept
values that follow them, with a probability from their relative attention; their keys are dropped.

Clusterer "cam": eviction as ``evict`` (default scorer "recency": CaM on a StreamingLLM cache, as
the authors' code), then for every evicted slot e its span = the up to ``span`` nearest kept
clusterable slots of its chunk right after it (before it when none follow), never crossing a
protected slot or an anchor. e merges with probability p_e = A_e / mean(A over its span) (clipped
to [0, 1]), A from ``merge_scorer`` (default: attention from the last queries); otherwise it is
dropped. The plan's parent of a merging slot
is the far end of its span.

Merger "cam": every representative between a merged slot and its parent (the parent included)
receives an equal share 1/m of it (m = representatives in that range; a plain plan whose parent is
the next representative is the m = 1 case).
- proportional=False (the paper): v_j += v_e / m; keys and sizes untouched, as the method has no
  sizes. Attention then matches the paper whatever the proportional-attention flag says.
- proportional=True: the share carries size s_e / m, and v_j becomes the size-weighted mean
  (s_j v_j + sum s_e/m v_e) / (s_j + sum s_e/m); sizes add up (fractional when m > 1), so proportional
  attention sees the merged slot as the tokens it absorbed, each with the kept key (CaM drops keys).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..config import StrategySpec
from ..protocols import ClusterPlan
from ..registry import register_clusterer, register_merger
from ..types import NEG_INF, KVState
from ..validation import check_choice, check_int, require
from .eviction import EvictClusterer, as_spec, checked_scores, make_scorer
from .mergers import apply_merge_plan, is_identity_plan
from .spans import kept_order, span_parent, span_targets

MERGE_RULES = ("bernoulli", "threshold", "always")


@register_clusterer("cam")
@dataclass(frozen=True)
class CaMClusterer(EvictClusterer):
    """Evict like ``evict``, then plan CaM merges of the evicted slots into the kept ones after them.

    scorer:       eviction scorer (default "recency": sinks + recent window, as StreamingLLM)
    recent_share: as ``evict``
    merge_scorer: attention scorer for the merge probability (default: "attention" with
                  reduce="mean", the mean attention from the captured queries that see the slot;
                  CaM uses the current query's attention)
    span:         kept slots an evicted value is spread over (CaM's merge budget, 32 in its code)
    merge_rule:   "bernoulli" (the paper: merge with probability p_e), "threshold" (merge when
                  p_e >= threshold; the authors' deterministic variant uses p_e > 1) or "always"
    threshold:    for merge_rule="threshold"
    seed:         for merge_rule="bernoulli"; the draw also depends on the tokens seen
    """

    scorer: Any = "recency"
    recent_share: float = 0.0
    merge_scorer: Any = StrategySpec("attention", {"reduce": "mean"})
    span: int = 32
    merge_rule: str = "bernoulli"
    threshold: float = 1.0
    seed: int = 0
    _merge_scorer: Any = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        super().__post_init__()
        check_int("span", self.span, 1)
        check_choice("merge_rule", self.merge_rule, MERGE_RULES)
        require(isinstance(self.threshold, (int, float)) and not isinstance(self.threshold, bool)
                and self.threshold >= 0, "threshold", self.threshold, "a number >= 0")
        check_int("seed", self.seed, 0)
        spec = as_spec(self.merge_scorer, "merge_scorer")
        object.__setattr__(self, "merge_scorer", spec)
        impl = make_scorer(spec) if self.merge_rule != "always" else None
        object.__setattr__(self, "_merge_scorer", impl)

    def merge_probability(self, state: KVState, order, first: Tensor, last: Tensor) -> Tensor:
        """[B, H, N] float64 p_e = A_e / mean of A over the slot's span (1 if that mean is 0 and A_e > 0)."""
        A = checked_scores(self._merge_scorer, self.merge_scorer, state).double()
        A = A.masked_fill(~state.valid, 0.0).nan_to_num(0.0)
        B, H, K = order.slot.shape
        kA = A.gather(-1, order.slot.clamp(max=state.num_slots - 1)).masked_fill(order.slot >= state.num_slots, 0.0)
        prefix = torch.cat([kA.new_zeros(B, H, 1), kA.cumsum(-1)], dim=-1)  # [B, H, K + 1]
        mean = (prefix.gather(-1, last + 1) - prefix.gather(-1, first)) / (last - first + 1).double()
        return torch.where(mean > 0, A / mean.clamp(min=1e-300), (A > 0).double())

    def __call__(self, state: KVState, chunk_ids: Tensor, target: Tensor, round_idx: int = 0) -> ClusterPlan:
        free, keep = self.kept_free(state, chunk_ids, target)
        evicted = free & ~keep
        kept = state.valid & ~evicted
        order = kept_order(kept, free & keep, chunk_ids)
        first, last, ok, after = span_targets(order, evicted, chunk_ids, self.span)
        first, last = first.clamp(min=0), last.clamp(min=0)
        if self.merge_rule != "always":
            p = self.merge_probability(state, order, first, last)
            if self.merge_rule == "bernoulli":
                gen = torch.Generator().manual_seed(self.seed + state.num_tokens)
                draw = torch.rand(p.shape, generator=gen, dtype=torch.float64).to(p.device)
                ok = ok & (draw < p.clamp(0.0, 1.0))
            else:
                ok = ok & (p >= self.threshold)
        slot = torch.arange(state.num_slots, device=chunk_ids.device).expand_as(chunk_ids)
        parent = torch.where(kept, slot, span_parent(order, first, last, ok, after))
        return ClusterPlan(parent, done=True)


def spread(x: Tensor, lo: Tensor, hi: Tensor, active: Tensor) -> Tensor:
    """Every slot in [lo[n], hi[n]] receives x[n], for active n (a difference array, summed).

    x: [B, H, N, *E]; lo, hi: [B, H, N] long (lo <= hi); active: [B, H, N] bool
    returns [B, H, N, *E] in x's dtype
    """
    B, H, N = lo.shape
    extra = x.shape[3:]
    x = x * active.view(B, H, N, *([1] * len(extra))).to(x.dtype)
    buf = x.new_zeros(B, H, N + 1, *extra)

    def idx(i: Tensor) -> Tensor:
        i = torch.where(active, i, N)
        return i.view(B, H, N, *([1] * len(extra))).expand_as(x)

    buf.scatter_add_(2, idx(lo), x)
    buf.scatter_add_(2, idx(hi + 1), -x)
    return buf.cumsum(2)[:, :, :N]


@register_merger("cam")
@dataclass(frozen=True)
class CaMMerger:
    """Spread each merged slot over the representatives between it and its parent (parent included).

    proportional: False (the paper: values added as v_e / m, keys and sizes untouched) or True
                  (size-weighted mean of values, sizes add up; consistent with proportional attention)
    Per-slot stats (accumulated attention) are spread the same way in both modes. Representatives
    that receive nothing stay bit-for-bit as they were.
    """

    proportional: bool = False

    def __post_init__(self):
        require(isinstance(self.proportional, bool), "proportional", self.proportional, "True or False")

    def __call__(self, state: KVState, parent: Tensor) -> KVState:
        B, H, N, D = state.keys.shape
        require(tuple(parent.shape) == (B, H, N), "parent", tuple(parent.shape), f"shape {(B, H, N)}")
        if is_identity_plan(state, parent):
            return state
        slot = torch.arange(N, device=parent.device)
        valid = state.valid
        safe = parent.clamp(min=0)
        is_rep = (parent == slot) & valid
        merged = valid & (parent >= 0) & ~is_rep
        require(bool(is_rep.gather(-1, safe)[merged].all()), "parent",
                "a plan whose target is not a representative", "parent[parent[n]] == parent[n]")
        if not bool(merged.any()):
            return apply_merge_plan(state, parent)

        lo = torch.where(safe > slot, slot + 1, safe)
        hi = torch.where(safe > slot, safe, slot - 1)
        reps = is_rep.long().cumsum(-1)
        below = torch.where(lo > 0, reps.gather(-1, (lo - 1).clamp(min=0)), 0)
        m = torch.where(merged, reps.gather(-1, hi.clamp(min=0)) - below, 1).clamp(min=1)
        covered = is_rep & (spread(merged.long(), lo, hi, merged) > 0)  # exact integer coverage
        share = merged.double() / m.double()  # [B, H, N] fraction of e each target gets

        values = state.values.double()
        sizes = state.token_counts().double().masked_fill(~valid, 0.0)
        counts = state.counts
        if self.proportional:
            mass = sizes * share
            new_sizes = sizes + spread(mass, lo, hi, merged)
            new_values = (sizes[..., None] * values + spread(mass[..., None] * values, lo, hi, merged))
            new_values = new_values / new_sizes.clamp(min=1e-300)[..., None]
            log_sizes = torch.where(covered, new_sizes.log().float(), state.log_sizes)
            if counts is not None:
                counts = torch.where(covered, new_sizes.float(), counts)
        else:
            new_values = values + spread(share[..., None] * values, lo, hi, merged)
            log_sizes = state.log_sizes
        values_out = torch.where(covered[..., None], new_values.to(state.values.dtype), state.values)

        stats = {}
        for name, x in state.stats.items():
            if x.is_floating_point():
                w = share.view(B, H, N, *([1] * (x.dim() - 3)))
                got = spread(x.double() * w, lo, hi, merged)
                cov = covered.view(B, H, N, *([1] * (x.dim() - 3)))
                x = torch.where(cov, (x.double() + got).to(x.dtype), x)
            stats[name] = x
        spread_state = state.replace(values=values_out, log_sizes=log_sizes.masked_fill(~valid, NEG_INF),
                                     counts=counts, stats=stats)
        # merged slots are fully absorbed: drop them and compact the representatives
        return apply_merge_plan(spread_state, torch.where(merged, -1, parent))
