"""Eviction as a clusterer: a plan whose parent is the slot itself (kept) or -1 (dropped).

The ``evict`` clusterer keeps, per head, exactly as many clusterable slots as the budget leaves
after protected slots and anchors: first the most recent ``recent_share`` of them (H2O's recent
half), then the best by a registered scorer. StreamingLLM is ``evict`` with the "recency" scorer
behind attention sinks: the recent window is whatever the budget leaves after the sinks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..config import StrategySpec
from ..protocols import ClusterPlan, Needs, needs_of
from ..registry import SCORERS, register_clusterer, register_merger
from ..types import KVState
from ..validation import check_choice, check_range, require

HEAD_BUDGETS = ("uniform", "adaptive", "adaptive-sum")

_FINITE_MIN = torch.finfo(torch.float32).min


def rank_desc(key: Tensor, candidate: Tensor) -> Tensor:
    """Rank of every candidate by ``key``, highest first, ties to the lower slot index.

    key:       [B, H, N] float (NaN counts as the lowest score)
    candidate: [B, H, N] bool
    returns    [B, H, N] long rank among candidates (0 = best); non-candidates rank after all
    """
    k = key.float().nan_to_num(nan=_FINITE_MIN, posinf=float("inf"), neginf=_FINITE_MIN)
    k = torch.where(candidate, k.clamp(min=_FINITE_MIN), float("-inf"))  # candidates beat the rest
    N = k.shape[-1]
    if N > 1:
        # keys strictly increasing along the candidates (positions before any merge: the recency
        # ranking): the sort's ranks by counting, the candidates from the last one, the others
        # after them in slot order
        prev = torch.cummax(k, -1).values[..., :-1]  # the largest candidate key before slot n + 1
        if bool((k[..., 1:] > prev)[candidate[..., 1:]].all()):
            c = candidate.long().cumsum(-1)
            count = c[..., -1:]
            slot = torch.arange(N, device=k.device)
            return torch.where(candidate, count - c, count + slot - c)
    order = torch.sort(k, dim=-1, descending=True, stable=True).indices
    ranks = torch.empty_like(order)
    ranks.scatter_(-1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order))
    return ranks


def free_quota(state: KVState, free: Tensor, target: Tensor) -> Tensor:
    """[B, H] long: clusterable slots a head may keep so that it ends at its target (>= 0)."""
    fixed = (state.valid & ~free).sum(-1)  # protected slots and anchors always stay
    return (target.to(fixed.device) - fixed).clamp(min=0)


def select_kept(state: KVState, free: Tensor, target: Tensor, scores: Tensor, recent_share: float,
                head_budget: str = "uniform", head_floor: float = 0.2) -> Tensor:
    """[B, H, N] bool: the clusterable slots to keep.

    free:   [B, H, N] bool clusterable slots (valid, not protected, in a chunk)
    target: [B, H] long slots per head; scores: [B, H, N] (higher = keep)
    The most recent floor(quota * recent_share) free slots are kept first, then the best-scored:
    per head ("uniform"), or by Ada-KV's one score threshold over all heads of the layer
    ("adaptive": no head above its target, the padded layer tensor is the budget; "adaptive-sum":
    the per-head counts sum to the layer's budget; see importance.adaptive_keep).
    """
    quota = free_quota(state, free, target)[..., None]  # [B, H, 1]
    n_recent = torch.floor(quota.double() * recent_share + 1e-9).long()
    keep = free & (rank_desc(state.positions, free) < n_recent)
    rest = free & ~keep
    if head_budget != "uniform":
        from .importance import adaptive_keep

        return keep | adaptive_keep(scores, rest, (quota - n_recent)[..., 0], head_floor,
                                    rectangular=head_budget == "adaptive")
    return keep | (rest & (rank_desc(scores, rest) < quota - n_recent))


def as_spec(value: Any, what: str) -> StrategySpec:
    return StrategySpec.coerce(value, what)


def make_scorer(spec: StrategySpec):
    return SCORERS.create(spec.name, spec.params)


def checked_scores(scorer, spec: StrategySpec, state: KVState) -> Tensor:
    scores = scorer(state)
    require(isinstance(scores, Tensor) and tuple(scores.shape) == tuple(state.log_sizes.shape),
            f"scorer {spec.name!r} output", tuple(getattr(scores, "shape", ())),
            f"a [B, H, N] tensor of shape {tuple(state.log_sizes.shape)}")
    return scores


@register_clusterer("evict")
@dataclass(frozen=True)
class EvictClusterer:
    """Keep the best clusterable slots per head, drop the rest (parent -1); no merging.

    scorer:       a registered scorer: name, {"name", "params"} or StrategySpec (default "knorm")
    recent_share: fraction in [0, 1] of the kept clusterable slots reserved for the most recent
                  ones before the scorer picks the rest (H2O: 0.5)
    head_budget:  "uniform" (every head keeps its target), "adaptive" (Ada-KV's one score
                  threshold over all heads of a layer, lowered until the first head reaches its
                  target: per-head counts differ, none above its target, so the layer tensor,
                  padded to its longest head, is the budget: real memory) or "adaptive-sum"
                  (Ada-KV's accounting: one top-k over all heads, per-head counts sum to the
                  layer's budget; the tensor is padded to the longest head, so memory is that
                  head's count times the heads: no memory saved)
    head_floor:   with "adaptive*", the share of its uniform quota every head keeps first

    Each head keeps exactly its target when it holds enough clusterable slots: target minus its
    protected slots and anchors. One round; ties go to the earlier slot.
    """

    scorer: Any = "knorm"
    recent_share: float = 0.0
    head_budget: str = "uniform"
    head_floor: float = 0.2
    _scorer: Any = field(init=False, repr=False, compare=False)

    # decoding re-scores every slot: scores (accumulated attention, recency) change as tokens arrive
    decode_scope = "all"

    def __post_init__(self):
        spec = as_spec(self.scorer, "scorer")
        object.__setattr__(self, "scorer", spec)
        check_range("recent_share", self.recent_share, 0.0, 1.0)
        check_choice("head_budget", self.head_budget, HEAD_BUDGETS)
        check_range("head_floor", self.head_floor, 0.0, 1.0)
        object.__setattr__(self, "_scorer", make_scorer(spec))

    @property
    def budget_scope(self) -> str:
        """"layer" when the budget is met by the heads' sum ("adaptive-sum"), else "head"."""
        return "layer" if self.head_budget == "adaptive-sum" else "head"

    @property
    def needs(self) -> Needs:
        return needs_of(self._scorer)

    def min_slots(self, valid: Tensor, chunk_ids: Tensor) -> Tensor:
        """[B, H] long: the fewest slots one call can reach: every clusterable slot may go, so
        only protected slots and anchors remain (no one-slot-per-chunk floor as for merging)."""
        return (valid & (chunk_ids < 0)).sum(-1)

    def kept_free(self, state: KVState, chunk_ids: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
        """(free, keep): [B, H, N] bool clusterable slots and the ones kept among them."""
        free = (chunk_ids >= 0) & state.valid
        if self.recent_share >= 1.0:  # nothing left for the scorer: skip its statistics
            scores = torch.zeros_like(state.log_sizes)
        else:
            scores = checked_scores(self._scorer, self.scorer, state)
        return free, select_kept(state, free, target, scores, self.recent_share, self.head_budget, self.head_floor)

    def __call__(self, state: KVState, chunk_ids: Tensor, target: Tensor, round_idx: int = 0) -> ClusterPlan:
        free, keep = self.kept_free(state, chunk_ids, target)
        slot = torch.arange(state.num_slots, device=chunk_ids.device).expand_as(chunk_ids)
        parent = torch.where(state.valid & ~(free & ~keep), slot, -1)
        return ClusterPlan(parent, done=True)


@register_clusterer("keep")
@dataclass(frozen=True)
class KeepAllClusterer:
    """Keep every slot (the ``full`` reference): parent[n] = n."""

    decode_scope = "all"

    def min_slots(self, valid: Tensor, chunk_ids: Tensor) -> Tensor:
        return valid.sum(-1)

    def __call__(self, state: KVState, chunk_ids: Tensor, target: Tensor, round_idx: int = 0) -> ClusterPlan:
        slot = torch.arange(state.num_slots, device=chunk_ids.device).expand_as(chunk_ids).clone()
        return ClusterPlan(slot, done=True)


@register_merger("identity")
@dataclass(frozen=True)
class IdentityMerger:
    """Return the state unchanged, padding and slot layout included (the ``full`` reference).

    Only plans that keep every valid slot as it is are accepted: anything else is a ValueError,
    since silently ignoring a merge or a drop would misreport the budget.
    """

    def __call__(self, state: KVState, parent: Tensor) -> KVState:
        slot = torch.arange(state.num_slots, device=parent.device)
        require(bool((parent == slot)[state.valid].all()), "parent", "a plan that merges or drops slots",
                "a plan that keeps every valid slot (use merger 'mean' with clusterers that drop or merge)")
        return state
