"""CentroidKV's Chunked Soft Matching (CSM), per KV head, vectorised over batch, heads and chunks.

One round, per head:
1. the clusterable slots (not sinks, not the recent window, not otherwise protected) are cut into
   chunks of ``size`` consecutive slots (the "csm" chunker below);
2. inside each chunk the slots split into A (odd local indices) and B (even ones);
3. each A slot finds its most similar B slot of the same chunk by key cosine (an edge);
4. the edges of all chunks of the head are pooled and ranked by similarity; the best
   k = min(ceil(r_j * clusterable), |A|, slots - target) merge. Several A may join one B; B slots
   are never merged in the same round, so at most half of a chunk merges per round, and the last
   round merges exactly what the budget still needs.

The pipeline runs rounds and applies the merger (the size-weighted "degree" merger) between them;
the next round re-chunks the reduced cache, so a centroid can absorb more tokens later.
Progressive schedule: r_j = max(r_init - j * delta_r, r_min): later rounds are more selective.

Cost per round: O(n c d) for n clusterable slots and chunk size c (an (c/2) x (c/2) block of
cosines per chunk), against O(n^2 d) for all-pairs matching.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..protocols import ClusterPlan
from ..registry import register_chunker, register_clusterer
from ..types import KVState
from ..validation import check_choice, check_int, check_range, require
from .chunkers import FixedSizeChunker
from .partitions import PARTITIONS, ab_indices
from .scratch import scratch
from .segments import build_segments

# r_j * n is rounded up, and a product like 0.3 * 10 lands a hair above 3 in floating point.
_CEIL_SLACK = 1e-9
_NORM_EPS = 1e-12  # F.normalize's default eps


@register_chunker("csm")
@dataclass(frozen=True)
class CSMChunker:
    """CentroidKV's chunks: ``size`` consecutive clusterable slots (re-cut every round).

    Counting slots, not tokens, keeps every round's chunks full however much earlier rounds
    merged; protected slots are skipped and do not split a chunk.
    """

    size: int = 256
    holes_ok = True  # sees slots through valid and slot order only (HoleTolerant: rounds in place)

    def __post_init__(self):
        check_int("size", self.size, 2)  # a chunk of one slot has no A/B pair

    def __call__(self, state: KVState, protected: Tensor) -> Tensor:
        return FixedSizeChunker(size=self.size, by="slots")(state, protected)


@dataclass(frozen=True)
class MatchEdges:
    """The A -> best-B edges of one round, flattened over all chunks of all heads.

    row:   [E] long   flattened (batch * heads) row
    src:   [E] long   slot of the A token (merges)
    dst:   [E] long   slot of its most similar B token in the same chunk (stays)
    score: [E] float  key cosine of the pair
    """

    row: Tensor
    src: Tensor
    dst: Tensor
    score: Tensor


def match_edges(keys: Tensor, chunk_ids: Tensor, valid: Tensor, partition: str = "alternating",
                generator: torch.Generator | None = None) -> MatchEdges:
    """Every A slot's best B slot (by key cosine) inside its chunk.

    keys:      [R, N, D]  (R = batch * heads)
    chunk_ids: [R, N] long (-1 = not clustered)
    valid:     [R, N] bool
    Ties go to the earliest B slot of the chunk.
    """
    R, N, D = keys.shape
    # rows are normalised after the gather: the same numbers (a row's norm is its own), for the
    # clustered slots only, not every slot of every round's cache
    flat = keys.float().reshape(R * N, D)
    layout = build_segments(torch.where(valid, chunk_ids, -1), min_length=2)
    rows, srcs, dsts, scores = [], [], [], []
    for bucket in layout.buckets:
        S, L = bucket.mask.shape
        a_idx, a_ok, b_idx, b_ok = ab_indices(bucket.mask, partition, generator)  # [S, La], [S, Lb]
        base = bucket.rows[:, None] * N
        a_flat = base + bucket.slots.gather(1, a_idx)  # [S, La] index into [R * N]
        b_flat = base + bucket.slots.gather(1, b_idx)  # [S, Lb]
        # padded B columns repeat the segment's first B: whichever copy wins, the edge points to
        # a real B slot, and no mask pass over the similarities is needed
        b_flat = torch.where(b_ok, b_flat, b_flat[:, :1])
        # A and B rows in one gather (index_select: a plain row copy, faster than [idx]), unit
        # rows in place: F.normalize's numbers (the norm clamped at its eps), fewer buffers
        # (both into pooled buffers: neither leaves the call, and fresh ones cost their page faults
        # every round of every layer)
        picked = torch.cat([a_flat.reshape(-1), b_flat.reshape(-1)])
        ab = torch.index_select(flat, 0, picked, out=scratch("csm.ab", (picked.numel(), D), flat.dtype, flat.device))
        ab.div_(torch.linalg.vector_norm(ab, dim=-1, keepdim=True).clamp_min_(_NORM_EPS))
        ka, kb = ab[: a_flat.numel()].view(S, -1, D), ab[a_flat.numel():].view(S, -1, D)
        sim = torch.bmm(ka, kb.transpose(1, 2), out=scratch("csm.sim", (S, ka.shape[1], kb.shape[1]), ab.dtype,
                                                             ab.device))  # [S, La, Lb]
        best, arg = sim.max(-1)  # [S, La]; first maximum on ties
        pick = a_ok.flatten().nonzero().squeeze(1)
        a_sel = a_flat.flatten().index_select(0, pick)
        rows.append(torch.div(a_sel, N, rounding_mode="floor"))
        srcs.append(a_sel % N)
        dsts.append(b_flat.gather(1, arg).flatten().index_select(0, pick) % N)
        scores.append(best.flatten().index_select(0, pick))
    if not rows:
        empty = torch.zeros(0, dtype=torch.long, device=keys.device)
        return MatchEdges(empty, empty, empty, torch.zeros(0, device=keys.device))
    return MatchEdges(torch.cat(rows), torch.cat(srcs), torch.cat(dsts), torch.cat(scores))


def rank_within_rows(row: Tensor, score: Tensor, num_rows: int) -> tuple[Tensor, Tensor]:
    """Order edges by row, then by descending score (ties keep their order), and number them
    inside each row.

    row, score: [E] (scores are cosines, in [-1, 1])
    returns order [E] (a permutation of the edges) and rank [E] (0 = best edge of its row,
    indexed like ``order``)
    """
    # one sort on a composite key: rows 4 apart, 1 - cosine in [0, 2] inside a row (exact in float64)
    key = row.double() * 4.0 + (1.0 - score.double().clamp(-1.0, 1.0))
    order = _stable_argsort_nonnegative(key)
    counts = torch.bincount(row, minlength=num_rows)
    starts = counts.cumsum(0) - counts
    rank = torch.arange(row.numel(), device=row.device) - starts[row[order]]
    return order, rank


def _stable_argsort_nonnegative(key: Tensor) -> Tensor:
    """``key.argsort(stable=True)`` for a float64 key of values >= +0.0 (or NaN), faster.

    Non-negative doubles order as their bit patterns read as int64 (equal values, equal bits: no
    -0.0 here, the key is a sum of non-negative terms), so the int64 argsort gives the same
    permutation, ties in edge order included; torch sorts int64 by radix, several times faster
    than float64 at the edge counts of a round (4.5 against 0.7 ms at 50k edges). A NaN key
    (a NaN score) sorts last in the float sort whatever its payload: that case keeps the float sort."""
    if key.dtype != torch.float64 or bool(torch.isnan(key).any()):
        return key.argsort(stable=True)
    return key.view(torch.int64).argsort(stable=True)


@register_clusterer("csm")
@dataclass(frozen=True)
class ChunkedSoftMatching:
    """CentroidKV's CSM clusterer with a progressive merge-rate schedule.

    r_init:    merge rate of round 0, in (0, 0.5]: the share of a head's clusterable slots that
               may merge in a round (A is at most half of each chunk anyway)
    delta_r:   decrease of the rate per round, >= 0 (0 = fixed rate, the "schedule off" ablation)
    r_min:     floor of the rate, in [0, r_init]. With r_min = 0 the schedule stops merging after
               ceil(r_init / delta_r) rounds; if the budget is not met by then the pipeline raises
               BudgetError (on_infeasible="error") or returns the cache it reached with
               report.budget_met = False ("best_effort").
    partition: "alternating" (A = odd, B = even chunk positions), "contiguous" or "random"
    seed:      seed of the "random" partition (round j draws from seed + j)
    """

    r_init: float = 0.5
    delta_r: float = 0.1
    r_min: float = 0.1
    partition: str = "alternating"
    seed: int = 0

    # decode-time compression re-clusters every clusterable slot: centroids keep absorbing tokens
    decode_scope = "all"
    holes_ok = True  # chunks, A/B splits, quotas and edge order from valid slots in slot order (HoleTolerant)

    def __post_init__(self):
        check_range("r_init", self.r_init, 0.0, 0.5, lo_open=True)
        check_range("delta_r", self.delta_r, 0.0, 0.5)
        check_range("r_min", self.r_min, 0.0, self.r_init)
        check_choice("partition", self.partition, PARTITIONS)
        check_int("seed", self.seed, 0)

    def min_slots(self, valid: Tensor, chunk_ids: Tensor) -> Tensor:
        """[B, H] long: the fewest slots rounds can reach: chunks are re-cut from the merged slots
        every round, so all clusterable slots of a head can end in one centroid."""
        free = valid & (chunk_ids >= 0)
        return (valid & ~free).sum(-1) + free.any(-1).long()

    def rate(self, round_idx: int) -> float:
        """r_j = max(r_init - j * delta_r, r_min)."""
        return max(self.r_init - round_idx * self.delta_r, self.r_min)

    def __call__(self, state: KVState, chunk_ids: Tensor, target: Tensor, round_idx: int = 0) -> ClusterPlan:
        B, H, N, D = state.keys.shape
        R = B * H
        require(tuple(target.shape) == (B, H), "target", tuple(target.shape), f"shape {(B, H)}")
        device = state.keys.device
        valid = state.valid.reshape(R, N)
        cids = chunk_ids.reshape(R, N).to(device)
        slots = valid.sum(1)  # [R]
        need = (slots - target.reshape(R).to(device)).clamp(min=0)
        free = (valid & (cids >= 0)).sum(1)
        r = self.rate(round_idx)
        quota = torch.ceil(free.double() * r - _CEIL_SLACK).clamp(min=0).long()  # [R]

        slot = torch.arange(N, device=device)
        parent = torch.where(valid, slot, -1).reshape(R * N)
        if not bool((need > 0).any()) or r <= 0.0:
            return ClusterPlan(parent.view(B, H, N), done=True)

        generator = None
        if self.partition == "random":
            generator = torch.Generator().manual_seed(self.seed + round_idx)
        edges = match_edges(state.keys.reshape(R, N, D), cids, valid, self.partition, generator)
        num_a = torch.bincount(edges.row, minlength=R)
        k = torch.minimum(torch.minimum(quota, num_a), need)  # [R] merges this round
        order, rank = rank_within_rows(edges.row, edges.score, R)
        # the edges taken, in rank order; each A slot has one edge, so the writes never collide
        # and their order does not matter (``parent`` is this call's own tensor: no copy)
        sel = order[rank < k.index_select(0, edges.row.index_select(0, order))]
        parent[edges.row.index_select(0, sel) * N + edges.src.index_select(0, sel)] = edges.dst.index_select(0, sel)

        remaining = slots - k
        # done once every head meets its target, or no head can progress (r_j only falls)
        done = bool(((remaining <= target.reshape(R).to(device)) | (k == 0)).all())
        return ClusterPlan(parent.view(B, H, N), done=done)


__all__ = ["CSMChunker", "ChunkedSoftMatching", "MatchEdges", "match_edges", "rank_within_rows"]
