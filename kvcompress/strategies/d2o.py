"""D2O, Dynamic Discriminative Operations (Wan et al., 2024): token-level eviction plus
re-discrimination: an evicted token is merged into its most similar kept token (key cosine) when
the similarity reaches a threshold, else dropped; the threshold follows an EMA while decoding.

Clusterer "d2o": eviction as ``evict`` (default: H2O's heavy hitters + recent half), then every
evicted slot proposes its most similar kept clusterable slot of the same chunk as parent (a
*candidate*; -1 when there is none). The merger decides which candidates merge, so all threshold
state lives in one place.

Merger "d2o": u_e = cos(k_e, k_parent). The threshold of a (row, head):
- first compression (no ``state.extras["d2o_tau"]`` yet): ``threshold``, or, when None, D2O's
  initialisation tau_0 = mean of the candidates' u_e;
- later ones (decoding): tau_t = beta * mean(u_e) + (1 - beta) * tau_{t-1} (for one evicted token per
  step, as in D2O, the mean is that token's similarity).
Candidates with u_e >= tau merge, the others are dropped; tau is stored in extras["d2o_tau"] [B, H]
(NaN where never set). Weighted merging (D2O): the kept slot weighs e = exp(1) (its similarity with
itself is 1), each merged token exp(u_e); keys and values are those weighted means.
- proportional=False (the paper): as above, sizes untouched.
- proportional=True: each weight is multiplied by the slot's size and sizes add up, so merging
  exact duplicates is lossless under proportional attention.

D2O's layer-level part (a budget per layer from attention density) is not modelled: budgets here
are per layer as the pipeline sets them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..protocols import ClusterPlan
from ..registry import register_clusterer, register_merger
from ..types import NEG_INF, KVState
from ..validation import check_range, require
from .eviction import EvictClusterer
from .mergers import apply_merge_plan, is_identity_plan

TAU_KEY = "d2o_tau"  # state.extras: [B, H] float32 EMA threshold (NaN = not set yet)
_ROW_BLOCK = 1024  # evicted slots compared with the kept ones at a time, at most
# similarity entries [B, H, block, K] per block, written into one reused buffer: the product of
# an 8k cache (K ~ 2k kept slots, inner dimension 64) is bound by writing its output, and a fresh
# 25 MB block per step paid its page faults again (SmolLM2 8k: 85 instead of 120 ms a layer, of
# which the matmul alone is ~60 ms); 2 MB blocks also keep the row maximum's reads in cache
_BLOCK_ENTRIES = 1 << 19


def _compact(mask: Tensor) -> tuple[Tensor, Tensor]:
    """The True slots of each head first, in slot order: (index [B, H, K] long, ok [B, H, K] bool),
    K = the most True slots of any head (at least 1)."""
    count = mask.sum(-1)
    K = max(1, int(count.max()))
    order = torch.sort((~mask).long(), dim=-1, stable=True).indices[..., :K]
    return order, torch.arange(K, device=mask.device) < count[..., None]


_MAX_BLOCK = 64  # row_max: columns per block


def row_max(x: Tensor) -> tuple[Tensor, Tensor]:
    """``x.max(-1)``: (values, index of the FIRST maximum) [...], for x [..., K] without NaN.

    A max-with-index over long rows is several times slower on CPU than a plain max: take the
    maximum of every block of 64 columns (vectorised), pick the first block holding the row's
    maximum, and find the first equal entry inside that block only."""
    K = x.shape[-1]
    if K < 4 * _MAX_BLOCK:
        return x.max(-1)
    full = K // _MAX_BLOCK
    block_max = x[..., :full * _MAX_BLOCK].unflatten(-1, (full, _MAX_BLOCK)).amax(-1)  # [..., full]
    if full * _MAX_BLOCK < K:
        block_max = torch.cat([block_max, x[..., full * _MAX_BLOCK:].amax(-1, keepdim=True)], -1)
    val, blk = block_max.max(-1)  # the first block whose maximum is the row's
    start = blk * _MAX_BLOCK
    pos = (start[..., None] + torch.arange(_MAX_BLOCK, device=x.device)).clamp_(max=K - 1)  # past K: repeats
    first = (x.gather(-1, pos) == val[..., None]).to(torch.uint8).argmax(-1)  # the last column, after it
    return val, start + first


def most_similar_kept(keys: Tensor, evicted: Tensor, receiving: Tensor, chunk_ids: Tensor) -> tuple[Tensor, Tensor]:
    """For every evicted slot, its most similar receiving slot of the same chunk (key cosine).

    keys: [B, H, N, D]; evicted, receiving: [B, H, N] bool; chunk_ids: [B, H, N] long
    returns (parent [B, H, N] long slot or -1, similarity [B, H, N] float32, -inf where none);
            ties go to the earlier slot. Memory: [B, H, block, K] similarities at a time.

    Only the evicted rows are compared (gathered first), with the receiving slots in slot order;
    the chunk mask is applied only when some head holds more than one chunk or fewer receiving
    slots than the widest head (D2O's presets use one global chunk: then no mask at all).
    """
    B, H, N, D = keys.shape
    device = keys.device
    kn = F.normalize(keys.float(), dim=-1)
    order, k_ok = _compact(receiving)  # [B, H, K]
    e_order, e_ok = _compact(evicted)  # [B, H, E]
    K, E = order.shape[-1], e_order.shape[-1]
    k_keys = kn.gather(2, order[..., None].expand(B, H, K, D))
    e_keys = kn.gather(2, e_order[..., None].expand(B, H, E, D))
    k_chunk = torch.where(k_ok, chunk_ids.gather(-1, order), -2)
    e_chunk = chunk_ids.gather(-1, e_order)
    big = torch.iinfo(torch.long).max
    lo = torch.minimum(torch.where(k_ok, k_chunk, big).amin(-1), torch.where(e_ok, e_chunk, big).amin(-1))
    hi = torch.maximum(torch.where(k_ok, k_chunk, -big).amax(-1), torch.where(e_ok, e_chunk, -big).amax(-1))
    several = bool((lo < hi).any())  # some head compares across chunks: the chunk mask everywhere
    # else only the padding columns need masking: they trail each head's receiving slots, so the
    # columns before the fewest receiving slots of any head are real in every head
    first_pad = K if several else int(k_ok.sum(-1).min())
    masked = several or first_pad < K
    k_t = k_keys.transpose(-1, -2)  # [B, H, D, K]
    e_parent = torch.empty(B, H, E, dtype=torch.long, device=device)
    e_best = torch.empty(B, H, E, dtype=torch.float32, device=device)
    step = max(1, min(_ROW_BLOCK, _BLOCK_ENTRIES // max(1, B * H * K)))
    buf = torch.empty(B, H, step, K, dtype=torch.float32, device=device)
    for n0 in range(0, E, step):
        rows = slice(n0, min(E, n0 + step))
        b = rows.stop - n0
        out = buf if b == step else torch.empty(B, H, b, K, dtype=torch.float32, device=device)
        sims = torch.matmul(e_keys[:, :, rows], k_t, out=out)  # [B, H, b, K]
        if several:
            sims.masked_fill_(k_chunk[:, :, None, :] != e_chunk[:, :, rows, None], NEG_INF)
        elif masked:  # (padding rows of e are dropped by ``has`` below, whatever their values)
            sims[..., first_pad:].masked_fill_(~k_ok[:, :, None, first_pad:], NEG_INF)
        val, idx = row_max(sims)
        has = e_ok[:, :, rows] & (val > NEG_INF)
        e_parent[:, :, rows] = torch.where(has, order.gather(-1, idx), -1)
        e_best[:, :, rows] = torch.where(has, val, NEG_INF)
    # back to slot order; padding rows of heads with fewer evicted slots write into a trash column
    dest = torch.where(e_ok, e_order, N)
    parent = torch.full((B, H, N + 1), -1, dtype=torch.long, device=device).scatter_(-1, dest, e_parent)
    best = torch.full((B, H, N + 1), NEG_INF, dtype=torch.float32, device=device).scatter_(-1, dest, e_best)
    return parent[..., :N], best[..., :N]


@register_clusterer("d2o")
@dataclass(frozen=True)
class D2OClusterer(EvictClusterer):
    """Evict like ``evict``; each evicted slot proposes its most similar kept slot as parent.

    scorer:       eviction scorer (default "h2o": accumulated attention)
    recent_share: share of the kept clusterable slots given to the most recent ones (default
                  0.5: H2O's heavy/recent split, which D2O builds on)
    """

    scorer: Any = "h2o"
    recent_share: float = 0.5

    def __call__(self, state: KVState, chunk_ids: Tensor, target: Tensor, round_idx: int = 0) -> ClusterPlan:
        free, keep = self.kept_free(state, chunk_ids, target)
        evicted = free & ~keep
        candidate, _ = most_similar_kept(state.keys, evicted, free & keep, chunk_ids)
        slot = torch.arange(state.num_slots, device=chunk_ids.device).expand_as(chunk_ids)
        parent = torch.where(state.valid & ~evicted, slot, candidate)
        return ClusterPlan(parent, done=True)


@register_merger("d2o")
@dataclass(frozen=True)
class D2OMerger:
    """Threshold the candidate merges and apply D2O's similarity-weighted merge.

    threshold:    tau at the first compression (None: mean similarity of the candidates, D2O's tau_0)
    beta:         EMA weight of the newest similarities while decoding (a choice: the paper's
                  value is not in our notes)
    proportional: weigh by sizes and add sizes up (True) or not (False, the paper)
    """

    threshold: float | None = None
    beta: float = 0.7
    proportional: bool = False

    def __post_init__(self):
        if self.threshold is not None:
            check_range("threshold", self.threshold, -1.0, 1.0)
        check_range("beta", self.beta, 0.0, 1.0)
        require(isinstance(self.proportional, bool), "proportional", self.proportional, "True or False")

    def threshold_for(self, state: KVState, sim: Tensor, candidate: Tensor) -> Tensor:
        """[B, H] float32 tau used now: initial value or EMA update (NaN where still unset)."""
        B, H = sim.shape[:2]
        n = candidate.sum(-1)  # [B, H]
        mean = torch.where(candidate, sim, 0.0).sum(-1) / n.clamp(min=1)
        mean = torch.where(n > 0, mean, float("nan"))
        prev = state.extras.get(TAU_KEY)
        if prev is not None:
            require(isinstance(prev, Tensor) and tuple(prev.shape) == (B, H), f"state.extras[{TAU_KEY!r}]",
                    tuple(getattr(prev, "shape", ())), f"shape {(B, H)}")
            prev = prev.float().to(sim.device)
        else:
            prev = torch.full((B, H), float("nan"), device=sim.device)
        init = mean if self.threshold is None else torch.full_like(mean, float(self.threshold))
        ema = self.beta * mean + (1.0 - self.beta) * prev
        tau = torch.where(torch.isnan(prev), init, torch.where(n > 0, ema, prev))
        return tau.float()

    def __call__(self, state: KVState, parent: Tensor) -> KVState:
        B, H, N, D = state.keys.shape
        require(tuple(parent.shape) == (B, H, N), "parent", tuple(parent.shape), f"shape {(B, H, N)}")
        slot = torch.arange(N, device=parent.device)
        valid = state.valid
        safe = parent.clamp(min=0)
        is_rep = (parent == slot) & valid
        candidate = valid & (parent >= 0) & ~is_rep
        kn = F.normalize(state.keys.float(), dim=-1)
        sim = (kn * kn.gather(2, safe[..., None].expand(B, H, N, D))).sum(-1)  # [B, H, N]
        tau = self.threshold_for(state, sim, candidate)
        merged = candidate & (sim >= tau[..., None])
        plan = torch.where(candidate & ~merged, -1, parent)
        extras = {**state.extras, TAU_KEY: tau}
        if is_identity_plan(state, plan):
            return state.replace(extras=extras)

        sizes = state.token_counts()
        weight = torch.where(merged, sim.double().exp(), math.e)  # the kept slot: exp(cos(k, k)) = e
        if self.proportional:
            weight = weight * sizes.double()
        log_w = torch.where(valid & (plan >= 0), weight.log().float(), NEG_INF)
        # apply_merge_plan's size-weighted mean with the D2O weights in place of sizes ...
        out = apply_merge_plan(state.replace(log_sizes=log_w, counts=None, extras=extras), plan)
        # ... then the true sizes: summed over members (proportional) or the kept slot's own
        kept = plan >= 0
        contrib = torch.where(kept & (is_rep | self.proportional), sizes, 0.0)
        out_index = is_rep.long().cumsum(-1) - 1
        M = out.num_slots
        dest = torch.where(kept, out_index.gather(-1, plan.clamp(min=0)), M)
        total = torch.zeros(B, H, M + 1, dtype=torch.float32, device=sizes.device).scatter_add_(-1, dest, contrib)
        members = torch.zeros_like(total).scatter_add_(-1, dest, kept.float())
        rep_log = torch.full_like(total, NEG_INF).scatter_(-1, torch.where(is_rep, out_index, M), state.log_sizes)
        # singletons keep their exact log-size; merged slots get log(sum)
        log_sizes = torch.where(members > 1, total.clamp(min=1e-30).log(), rep_log)[..., :M]
        log_sizes = log_sizes.masked_fill(~out.valid, NEG_INF)
        counts = None if state.counts is None else total[..., :M].masked_fill(~out.valid, 0.0).contiguous()
        return out.replace(log_sizes=log_sizes.contiguous(), counts=counts)
