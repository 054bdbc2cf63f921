"""Greedy Seed-based Clustering (SemantiCache), per KV head, vectorised over batch, heads and chunks.

Inside each chunk, walk the slots in order; the first unassigned slot becomes a seed and absorbs
every LATER unassigned slot of its chunk whose key cosine similarity with the SEED's key is > tau.
One pass; clusters never cross chunks. The loop below runs over the position inside a chunk
(at most the bucket length), never over tokens.

Budget: with ``tau=None`` a per-head threshold is searched so that each head ends with at most
its target slots; the highest feasible tau (fewest merges) wins. The search evaluates
``search_width`` thresholds at once per pass and narrows the bracket ``search_passes`` times.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..protocols import ClusterPlan
from ..registry import register_clusterer
from ..types import KVState
from ..validation import check_int, check_range
from .segments import Bucket, SegmentLayout, build_segments

TAU_NO_MERGE = 1.0001  # above any cosine (rounding included): nothing merges
TAU_MERGE_ALL = -1.0001  # below any cosine: a seed absorbs its whole chunk


def _bucket_similarity(kn: Tensor, bucket: Bucket, num_slots: int, dense_limit: int) -> tuple[Tensor, Tensor | None]:
    """Normalised keys of the bucket [S, L, D] and, when small enough, their cosines [S, L, L]."""
    seg_keys = kn[bucket.flat_index(num_slots)]  # [S, L, D]
    S, L, _ = seg_keys.shape
    sims = seg_keys @ seg_keys.transpose(1, 2) if S * L * L <= dense_limit else None
    return seg_keys, sims


def gsc_run(
    kn: Tensor,
    layout: SegmentLayout,
    tau: Tensor,
    outside: Tensor,
    want_plan: bool = False,
    dense_limit: int = 1 << 26,
    cache: dict | None = None,
):
    """Run GSC for C thresholds per row at once.

    kn:      [R * N, D] unit-norm keys
    tau:     [C, R] thresholds
    outside: [R] long, valid slots not in any bucket (each is its own cluster)
    returns  counts [C, R] (clusters + outside slots) and, if want_plan, per bucket the local
             seed index of every member [C, S, L]
    """
    C, R = tau.shape
    counts = outside[None, :].expand(C, R).clone()
    plans = []
    for b_idx, bucket in enumerate(layout.buckets):
        key = ("sim", b_idx)
        if cache is not None and key in cache:
            seg_keys, sims = cache[key]
        else:
            seg_keys, sims = _bucket_similarity(kn, bucket, layout.num_slots, dense_limit)
            if cache is not None:
                cache[key] = (seg_keys, sims)
        S, L = bucket.mask.shape
        t = tau[:, bucket.rows][..., None]  # [C, S, 1]
        assigned = (~bucket.mask)[None].expand(C, S, L).clone()  # padding counts as assigned
        seed_of = torch.arange(L, device=kn.device).expand(C, S, L).clone() if want_plan else None
        seeds = torch.zeros(C, S, dtype=torch.long, device=kn.device)
        ar = torch.arange(L, device=kn.device)
        for i in range(L):
            free_i = ~assigned[..., i]  # [C, S]: slot i starts a new cluster
            sim_i = sims[:, i, :] if sims is not None else torch.einsum("sld,sd->sl", seg_keys, seg_keys[:, i])
            absorb = (sim_i[None] > t) & ~assigned & free_i[..., None] & (ar > i)  # [C, S, L]
            if want_plan:
                seed_of.masked_fill_(absorb, i)
            assigned |= absorb
            seeds += free_i
        counts.index_add_(1, bucket.rows, seeds)
        plans.append(seed_of)
    return counts, plans


@register_clusterer("gsc")
@dataclass(frozen=True)
class GreedySeedClustering:
    """SemantiCache's GSC on key cosine similarity.

    tau:           fixed threshold in [-1, 1]; None searches a per-head tau that meets the budget
    search_width:  thresholds tried per search pass
    search_passes: bracket refinements (resolution ~ 2 / (search_width + 1) ** search_passes)
    dense_limit:   largest S * L * L similarity block precomputed per bucket (else row by row)
    """

    tau: float | None = None
    search_width: int = 15
    search_passes: int = 3
    dense_limit: int = 1 << 26

    def __post_init__(self):
        if self.tau is not None:
            check_range("tau", self.tau, -1.0, 1.0)
        check_int("search_width", self.search_width, 1)
        check_int("search_passes", self.search_passes, 1)
        check_int("dense_limit", self.dense_limit, 1)

    def __call__(self, state: KVState, chunk_ids: Tensor, target: Tensor, round_idx: int = 0) -> ClusterPlan:
        B, H, N, D = state.keys.shape
        R = B * H
        valid = state.valid.reshape(R, N)
        kn = F.normalize(state.keys.float(), dim=-1).reshape(R * N, D)
        layout = build_segments(chunk_ids.reshape(R, N), min_length=2)
        in_buckets = torch.zeros(R, dtype=torch.long, device=kn.device)
        for bucket in layout.buckets:
            in_buckets.index_add_(0, bucket.rows, bucket.mask.sum(1))
        outside = valid.sum(1) - in_buckets  # [R]
        target_rows = target.reshape(R).to(kn.device)
        cache: dict = {}

        if self.tau is not None:
            tau = torch.full((R,), float(self.tau), device=kn.device)
        else:
            tau = self._search(kn, layout, outside, target_rows, cache)
        _, seeds = gsc_run(kn, layout, tau[None], outside, want_plan=True,
                           dense_limit=self.dense_limit, cache=cache)

        slot = torch.arange(N, device=kn.device)
        parent = torch.where(valid, slot, -1).reshape(R * N).clone()
        for bucket, seed_of in zip(layout.buckets, seeds):
            seed_slot = bucket.slots.gather(1, seed_of[0])  # [S, L] slot index of each member's seed
            flat = bucket.flat_index(N)
            parent[flat[bucket.mask]] = seed_slot[bucket.mask]
        return ClusterPlan(parent.view(B, H, N), done=True, tau=tau.view(B, H))

    def _search(self, kn, layout, outside, target_rows, cache) -> Tensor:
        """[R] highest tau per row whose cluster count fits the row's target."""
        R = target_rows.numel()
        device = kn.device
        no_merge_count = outside + sum(
            (torch.zeros(R, dtype=torch.long, device=device).index_add_(0, b.rows, b.mask.sum(1))
             for b in layout.buckets), torch.zeros(R, dtype=torch.long, device=device))
        lo = torch.full((R,), TAU_MERGE_ALL, device=device)
        hi = torch.full((R,), TAU_NO_MERGE, device=device)
        if not layout.buckets:
            return hi
        C = self.search_width
        frac = torch.arange(1, C + 1, device=device, dtype=torch.float32)[:, None] / (C + 1)  # [C, 1]
        for _ in range(self.search_passes):
            cands = lo[None] + (hi - lo)[None] * frac  # [C, R], increasing in C
            counts, _ = gsc_run(kn, layout, cands, outside, dense_limit=self.dense_limit, cache=cache)
            feasible = counts <= target_rows[None]
            # highest feasible candidate per row (counts need not be monotone in tau)
            idx = torch.where(feasible, torch.arange(C, device=device)[:, None], -1).max(0).values  # [R]
            has = idx >= 0
            new_lo = torch.where(has, cands.gather(0, idx.clamp(min=0)[None])[0], lo)
            above = (idx + 1).clamp(max=C - 1)
            new_hi = torch.where(idx + 1 < C, cands.gather(0, above[None])[0], hi)
            lo, hi = new_lo, new_hi
        # rows that fit without merging keep everything
        return torch.where(no_merge_count <= target_rows, torch.full_like(lo, TAU_NO_MERGE), lo)
