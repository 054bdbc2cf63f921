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
    # the stable sort of ~mask without sorting: the n-th slot's place is its rank among the True
    # slots, or, for a False one, count + its rank among the False ones (n - trues up to n);
    # the same permutation (the False slots trail in slot order, as the sort put them)
    N = mask.shape[-1]
    trues = mask.cumsum(-1)  # [B, H, N] inclusive
    slot = torch.arange(N, device=mask.device)
    dest = torch.where(mask, trues - 1, count[..., None] + slot - trues)
    order = torch.empty_like(dest).scatter_(-1, dest, slot.expand_as(dest))[..., :K]
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


_COARSE_BLOCK = 64  # coarse search: columns per block of its candidate scan
_COARSE_MAX_DIM = 64  # head dimensions up to which the coarse search is the default: measured faster on real
# SmolLM2 keys (D = 64); on synthetic clustered keys of D = 128 it was slower (docs/performance.md)
_COARSE_MIN_ENTRIES = 1 << 23  # similarities below which the float32 search is used (measured crossover: 4 - 8 M)
_COARSE_ENTRIES = 1 << 21  # coarse search: bfloat16 similarities a block (4 MB), at most
_COARSE_CANDIDATES = 8  # re-scored candidates per row of a block, at most on average: else that block is exact
# (break-even: re-scoring ~10 candidates a row costs the block's float32 product)
_BF16_UNIT = 2.0 ** -8  # bfloat16's unit roundoff: 8 significant bits (7 stored), round to nearest
_F32_UNIT = 2.0 ** -24


def coarse_available(device: torch.device) -> bool:
    """Whether ``most_similar_kept`` searches in bfloat16 first by default: on a CPU with
    avx512_bf16, where a bfloat16 product of these shapes runs ~2x float32 (measured in
    docs/performance.md); elsewhere the float32 search (a GPU's float32 product is not the
    bottleneck, and a CPU without bfloat16 units is slower in bfloat16)."""
    return device.type == "cpu" and torch.cpu._is_avx512_bf16_supported()


def coarse_default(dim: int, entries: int, device: torch.device) -> bool:
    """``most_similar_kept``'s choice when ``coarse`` is None, for ``entries`` similarities of head
    dimension ``dim`` (small searches, e.g. while decoding: the coarse pass's fixed costs outweigh
    the product)."""
    return dim <= _COARSE_MAX_DIM and entries >= _COARSE_MIN_ENTRIES and coarse_available(device)


def block_rows(rows: int, width: int, coarse: bool) -> int:
    """Evicted rows per product block of ``width`` (B * H * K) similarities a row: float32 blocks
    of at most ``_BLOCK_ENTRIES``; bfloat16 ones larger (a bfloat16 product packs its right-hand
    side again at every call), of equal sizes (no small last block)."""
    if not coarse:
        return max(1, min(_ROW_BLOCK, _BLOCK_ENTRIES // max(1, width)))
    step = max(1, min(rows, _COARSE_ENTRIES // max(1, width)))
    return -(-rows // -(-rows // step))


def coarse_error_bound(dim: int) -> float:
    """A bound on |bfloat16 cosine - float32 cosine| for unit float32 vectors a, b of ``dim``
    components, the bfloat16 one computed as a bfloat16 matmul does on CPU (inputs rounded to
    bfloat16, exact products summed in float32, the sum rounded to bfloat16), the float32 one by
    any float32 summation order. With u = 2^-8, g = dim * 2^-24 / (1 - dim * 2^-24) and
    |a|, |b| <= n = 1 + (dim + 4) 2^-24 (the normalisation's rounding), by Cauchy-Schwarz:
    rounding the inputs moves the dot product by <= (2u + u^2) n^2, the float32 sum by
    <= g (1 + u)^2 n^2, the output rounding by <= u (1 + g)(1 + u)^2 n^2, and the float32
    reference is within g n^2 of the exact product; plus dim * 2^-120 for subnormal components
    (absolute, not relative, rounding; also what flushing them to zero costs) and 0.1 % slack.
    It assumes the float32 accumulation of oneDNN's and PyTorch's own CPU bfloat16 matmuls (a
    kernel summing in bfloat16 would break it); tests/test_d2o_coarse.py checks it on adversarial
    inputs, in the batched shapes the search uses."""
    u, n = _BF16_UNIT, 1.0 + (dim + 4) * _F32_UNIT
    g = dim * _F32_UNIT / (1.0 - dim * _F32_UNIT)
    bound = n * n * ((2 * u + u * u) + g * (1 + u) ** 2 + u * (1 + g) * (1 + u) ** 2 + g)
    return 1.001 * bound + dim * 2.0 ** -120


def rescore(a_t: Tensor, a_at: Tensor, b_t: Tensor, b_at: Tensor) -> Tensor:
    """Float32 dot products of P pairs of rows: [P] float32, each summed as a float32 matrix
    product's inner loop does, one fused multiply-add per term in order of d (the product of two
    float32 values is exact in float64; rounding the running sum to float32 after each term is the
    FMA's single rounding, except at a double-rounding midpoint, ~2^-28 a term). On the CPU measured
    (MKL's AVX-512 sgemm) it reproduces ``torch.matmul``'s float32 cosines bit for bit.

    a_t: [..., D, R] float32, contiguous (rows transposed: each term is one gather of P values);
    a_at: [P] long, the flat index of the pair's first row's term 0 in a_t (m * D * R + r);
    b_t, b_at: the same for the second rows."""
    D, R1, R2 = a_t.shape[-2], a_t.shape[-1], b_t.shape[-1]
    a_flat, b_flat = a_t.view(-1), b_t.view(-1)
    P = a_at.shape[0]
    # work buffers of P values reused across d, the indices moved on in place (a fresh index, term
    # and rounding per d cost ~1.4x: allocation, not arithmetic)
    ia, ib = a_at.clone(), b_at.clone()
    fa, fb = a_flat.new_empty(P), b_flat.new_empty(P)
    acc = torch.zeros(P, dtype=torch.float64, device=a_t.device)
    x, y = torch.empty_like(acc), torch.empty_like(acc)
    out = torch.zeros(P, dtype=torch.float32, device=a_t.device)
    for d in range(D):  # over the head dimension, not over tokens
        torch.index_select(a_flat, 0, ia, out=fa)
        torch.index_select(b_flat, 0, ib, out=fb)
        acc.add_(x.copy_(fa).mul_(y.copy_(fb)))  # the product exact in float64
        acc.copy_(out.copy_(acc))  # the sum rounded to float32 after every term
        ia.add_(R1)
        ib.add_(R2)
    return out


def _coarse_candidates(sims: Tensor, band: float, rows_ok: Tensor):
    """The candidates of every row of a masked bfloat16 block for the float32 maximum, or None when
    the block has too many (then the caller computes the block in float32).

    sims: [B, H, b, K] bfloat16, K a multiple of _COARSE_BLOCK, -inf where masked;
    rows_ok: [B, H, b] the rows to search (real rows with at least one receiving slot unmasked).
    returns (row [P] long: flat index into [B * H, b]; column [P] long).

    A row's candidates are its entries within ``band`` (twice the bfloat16 error bound) of the
    row's bfloat16 maximum: the float32 maximum's column is one of them (its bfloat16 value is at
    least its float32 value - bound >= every other float32 value - bound >= every other bfloat16
    value - 2 bound). The maxima of blocks of 64 columns are taken on the bfloat16 bits as int16
    (3x faster than a float32 copy and its max, 7x faster than bfloat16's own max): the bits of
    non-negative bfloat16 values order as their values, and every negative one is below them; so a
    block's maximum is exact where it is >= 0, and when the row's maximum is above ``band`` no
    negative entry can be a candidate. A row whose maximum is at most ``band`` (rare in real keys)
    takes all its unmasked entries as candidates."""
    B, H, b, K = sims.shape
    nb = K // _COARSE_BLOCK
    bits = sims.view(torch.int16).view(B, H, b, nb, _COARSE_BLOCK).amax(-1)  # [B, H, b, nb]
    block_max = torch.where(bits >= 0, bits.view(torch.bfloat16).float(), NEG_INF)
    row_top = block_max.amax(-1)  # [B, H, b]
    # a row whose maximum is not clearly positive: every unmasked entry is a candidate (finite ones)
    low = row_top <= band
    thr = torch.where(low, -torch.finfo(torch.float32).max, row_top - band)
    hit = (((block_max >= thr[..., None]) | low[..., None]) & rows_ok[..., None]).view(-1).nonzero().squeeze(-1)
    cap = _COARSE_CANDIDATES * B * H * b
    if hit.shape[0] > cap:
        return None
    row = hit // nb
    inside = sims.view(-1, _COARSE_BLOCK).index_select(0, hit).float() >= thr.view(-1)[row, None]  # [P_blocks, 64]
    which, offset = inside.nonzero().unbind(-1)
    if which.shape[0] > cap:
        return None
    return row[which], (hit[which] % nb) * _COARSE_BLOCK + offset


def most_similar_kept(keys: Tensor, evicted: Tensor, receiving: Tensor, chunk_ids: Tensor,
                      coarse: bool | None = None, similarities: bool = True) -> tuple[Tensor, Tensor | None]:
    """For every evicted slot, its most similar receiving slot of the same chunk (key cosine).

    keys: [B, H, N, D]; evicted, receiving: [B, H, N] bool; chunk_ids: [B, H, N] long
    coarse: search in bfloat16 first, then re-score the candidates in float32 (None: where
            ``coarse_available``, D <= 64 and B * H * E * K >= 2^23 similarities)
    similarities: False when only the parents are wanted (D2O's clusterer: its merger computes
            its own): then the similarity is None, and a coarse row with a single candidate takes
            it without re-scoring it (it is the float32 search's parent: the argmax is among the
            candidates); the parents are the same.
    returns (parent [B, H, N] long slot or -1, similarity [B, H, N] float32, -inf where none);
            ties go to the earlier slot. Memory: [B, H, block, K] similarities at a time.

    Only the evicted rows are compared (gathered first), with the receiving slots in slot order;
    the chunk mask is applied only when some head holds more than one chunk or fewer receiving
    slots than the widest head (D2O's presets use one global chunk: then no mask at all).

    The coarse search (``_coarse_candidates``) returns the float32 search's parent: the float32 argmax,
    first column on ties, found among the candidates within twice ``coarse_error_bound`` of the
    bfloat16 maximum, each re-scored in float32 by ``rescore``. Its similarities are the same
    float32 cosines where ``rescore`` rounds as the BLAS does (bit for bit on the machine measured);
    on another BLAS they may differ in the last bits, and then so may the parent where two receiving
    slots tie within that rounding (either is the most similar). A block with more than 8
    candidates a row on average (keys this alike: tight clusters, near-duplicates) is computed in
    float32 instead, and so are all later blocks (the wasted work is one block's bfloat16 product).
    """
    B, H, N, D = keys.shape
    device = keys.device
    kn = F.normalize(keys.float(), dim=-1)
    order, k_ok = _compact(receiving)  # [B, H, K]
    e_order, e_ok = _compact(evicted)  # [B, H, E]
    K, E = order.shape[-1], e_order.shape[-1]
    if coarse is None:
        coarse = coarse_default(D, B * H * E * K, device)
    if coarse and K % _COARSE_BLOCK:  # whole blocks of columns: the extra ones are masked as padding
        pad = _COARSE_BLOCK - K % _COARSE_BLOCK
        order, k_ok = F.pad(order, (0, pad)), F.pad(k_ok, (0, pad))
        K += pad
    # whole rows by index_select (a gather through an index expanded over D is several times slower)
    base = torch.arange(B * H, device=device).view(B, H, 1) * N
    kn_rows = kn.reshape(B * H * N, D)
    k_keys = kn_rows.index_select(0, (base + order).view(-1)).view(B, H, K, D)
    e_keys = kn_rows.index_select(0, (base + e_order).view(-1)).view(B, H, E, D)
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

    def mask_(sims: Tensor, rows: slice) -> Tensor:
        if several:
            sims.masked_fill_(k_chunk[:, :, None, :] != e_chunk[:, :, rows, None], NEG_INF)
        elif masked:  # (padding rows of e are dropped by ``has`` below, whatever their values)
            sims[..., first_pad:].masked_fill_(~k_ok[:, :, None, first_pad:], NEG_INF)
        return sims

    k_t = k_keys.transpose(-1, -2)  # [B, H, D, K]
    e_parent = torch.empty(B, H, E, dtype=torch.long, device=device)
    e_best = torch.empty(B, H, E, dtype=torch.float32, device=device)
    step = block_rows(E, B * H * K, coarse=False)
    buf = torch.empty(B, H, min(step, E), K, dtype=torch.float32, device=device)

    def exact(r0: int, r1: int) -> None:  # float32 products, ``step`` rows at a time
        for n0 in range(r0, r1, step):
            rows = slice(n0, min(r1, n0 + step))
            b = rows.stop - n0
            out = buf if b == buf.shape[2] else torch.empty(B, H, b, K, dtype=torch.float32, device=device)
            e_best[:, :, rows], e_parent[:, :, rows] = row_max(mask_(torch.matmul(e_keys[:, :, rows], k_t, out=out),
                                                                     rows))

    if not coarse:
        exact(0, E)
    else:
        band = 2.0 * coarse_error_bound(D)
        e_bf, k_bf = e_keys.to(torch.bfloat16), k_t.to(torch.bfloat16)
        step_bf = block_rows(E, B * H * K, coarse=True)
        buf_bf = torch.empty(B, H, step_bf, K, dtype=torch.bfloat16, device=device)
        found = []  # (flat row of [B * H, E], column) of every coarse block's candidates
        # the rows with a receiving slot to compare with (the others' maximum is -inf in any precision)
        if several:  # receiving slots per (row, head, chunk id + 2), ids outside [-2, N) sharing the ends
            count = torch.zeros(B, H, N + 2, dtype=torch.long, device=device).scatter_add_(
                -1, (k_chunk + 2).clamp(0, N + 1), k_ok.long())  # (shared: an over-count, never missed)
            e_live = e_ok & (count.gather(-1, (e_chunk + 2).clamp(0, N + 1)) > 0)
        else:
            e_live = e_ok & k_ok.any(-1, keepdim=True)
        for n0 in range(0, E, step_bf):
            rows = slice(n0, min(E, n0 + step_bf))
            b = rows.stop - n0
            out = buf_bf if b == step_bf else torch.empty(B, H, b, K, dtype=torch.bfloat16, device=device)
            cand = _coarse_candidates(mask_(torch.matmul(e_bf[:, :, rows], k_bf, out=out), rows), band,
                                      e_live[:, :, rows])
            if cand is None:  # keys this alike make every block dense: the rest in float32 straight away
                exact(n0, E)
                break
            else:
                found.append((cand[0] // b * E + n0 + cand[0] % b, cand[1]))
                e_best[:, :, rows] = NEG_INF
        if found:  # every candidate re-scored in float32; a row's value is their maximum, its column
            # the first candidate reaching it (``max(-1)``'s tie order)
            row, col = (torch.cat(t) for t in zip(*found))
            if not similarities:  # a row's only candidate is its parent: no re-score (similarity 0, unused)
                alone = torch.zeros(B * H * E, dtype=torch.long, device=device).index_add_(
                    0, row, torch.ones_like(row)).index_select(0, row) == 1
                e_best.view(-1).index_fill_(0, row[alone], 0.0)
                e_parent.view(-1).index_copy_(0, row[alone], col[alone])
                row, col = row[~alone], col[~alone]
            bh = row // E
            kn_t = kn.transpose(-1, -2).contiguous()  # [B, H, D, N]: each term one gather
            # (cheaper than gathering the candidate rows and transposing them: P is often > B H N)
            slot_e = e_order.take(row)
            slot_k = order.take(bh * K + col)
            val = rescore(kn_t, bh * D * N + slot_e, kn_t, bh * D * N + slot_k)
            e_best.view(-1).scatter_reduce_(0, row, val, "amax")
            win = val == e_best.view(-1)[row]
            e_parent.view(-1).scatter_reduce_(0, row[win], col[win], "amin", include_self=False)
    has = e_ok & (e_best > NEG_INF)
    e_parent = torch.where(has, order.gather(-1, e_parent.clamp(0, K - 1)), -1)
    dest = torch.where(e_ok, e_order, N)  # back to slot order; padding rows of heads with fewer
    # evicted slots write into a trash column
    parent = torch.full((B, H, N + 1), -1, dtype=torch.long, device=device).scatter_(-1, dest, e_parent)
    if not similarities:
        return parent[..., :N], None
    e_best = torch.where(has, e_best, NEG_INF)
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
        candidate, _ = most_similar_kept(state.keys, evicted, free & keep, chunk_ids, similarities=False)
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
        # the parents' rows by index_select (a gather through an index expanded over D is several times slower)
        base = torch.arange(B * H, device=parent.device).view(B, H, 1) * N
        k_parent = kn.reshape(B * H * N, D).index_select(0, (base + safe).view(-1)).view(B, H, N, D)
        sim = (kn * k_parent).sum(-1)  # [B, H, N]
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
