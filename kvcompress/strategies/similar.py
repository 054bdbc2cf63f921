"""D2O's plan with its merge-or-drop test inside the plan, for mergers that merge every candidate.

The ``d2o`` clusterer proposes, for every evicted slot, its most similar kept slot; the ``d2o``
merger then merges a candidate only when the key cosine reaches a threshold and drops the others.
A merger without that test (``fitted``, ``mean``) would merge every candidate, however unlike its
receiver. Clusterer ``d2o-similar`` applies the test itself, so that only similar tokens merge:

- u_e = cos(k_e, k_parent) for every candidate e (an evicted slot with a receiver of its chunk);
- tau = ``threshold``, or, when None, the mean u_e over the candidates of the (row, head): D2O's
  initial threshold tau_0, recomputed at every compression (no EMA across decode-time
  compressions: the merger holds no state, and a decode-time compression evicts a batch of
  ``recompress_every`` slots, whose mean is a threshold of its own);
- candidates with u_e >= tau keep their parent (merge), the others get -1 (dropped).

The kept slots are ``evict``'s (scorer, recent share, Ada-KV budgets). With ``threshold=-1`` every
candidate merges (the plain ``d2o`` plan).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..protocols import ClusterPlan
from ..registry import register_clusterer
from ..types import KVState
from ..validation import check_range
from .d2o import D2OClusterer, most_similar_kept


def similar_only(candidate: Tensor, similarity: Tensor, threshold: float | None) -> Tensor:
    """[B, H, N] bool: the candidates that merge.

    candidate: [B, H, N] bool (evicted slots with a receiver); similarity: [B, H, N] float32 key
    cosine to the receiver; threshold: a fixed tau, or None for the per-(row, head) mean
    similarity of the candidates."""
    if threshold is None:
        n = candidate.sum(-1, keepdim=True)
        tau = torch.where(candidate, similarity, 0.0).sum(-1, keepdim=True) / n.clamp(min=1)
    else:
        tau = torch.full_like(similarity[..., :1], float(threshold))
    return candidate & (similarity >= tau)


@register_clusterer("d2o-similar")
@dataclass(frozen=True)
class SimilarD2OClusterer(D2OClusterer):
    """Evict like ``evict``; an evicted slot merges into its most similar kept slot when the key
    cosine reaches the threshold, else it is dropped (D2O's test, in the plan).

    scorer:       eviction scorer (default "h2o": accumulated attention)
    recent_share: share of the kept clusterable slots given to the most recent ones (default 0.5)
    threshold:    tau; None = the mean similarity of the (row, head)'s candidates (D2O's tau_0)
    """

    threshold: float | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.threshold is not None:
            check_range("threshold", self.threshold, -1.0, 1.0)

    def __call__(self, state: KVState, chunk_ids: Tensor, target: Tensor, round_idx: int = 0) -> ClusterPlan:
        free, keep = self.kept_free(state, chunk_ids, target)
        evicted = free & ~keep
        receiver, similarity = most_similar_kept(state.keys, evicted, free & keep, chunk_ids)
        merges = similar_only(evicted & (receiver >= 0), similarity, self.threshold)
        slot = torch.arange(state.num_slots, device=chunk_ids.device).expand_as(chunk_ids)
        parent = torch.where(state.valid & ~evicted, slot, torch.where(merges, receiver, -1))
        return ClusterPlan(parent, done=True)
