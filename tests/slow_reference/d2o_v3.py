"""Session 12's D2O search (kvcompress/strategies/d2o.py at main ffe1659), verbatim: ``_compact`` by a
stable sort, the candidate scan, and ``rescore`` (a fresh index, term and rounding per d), ``most_similar_kept`` re-scoring through a transposed copy of every
key and scattered takes; the D2O merger's __call__. The reference of session 14's row-gathered re-score and sort-free compaction."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from kvcompress.strategies.d2o import (_COARSE_BLOCK, _COARSE_CANDIDATES,
                                       block_rows, coarse_default, coarse_error_bound, row_max)
from kvcompress.strategies.d2o import TAU_KEY, D2OMerger as _FastD2OMerger
from kvcompress.strategies.mergers import apply_merge_plan, is_identity_plan
from kvcompress.types import NEG_INF, KVState
from kvcompress.validation import require


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
    acc = torch.zeros(a_at.shape[0], dtype=torch.float64, device=a_t.device)
    for d in range(D):  # over the head dimension, not over tokens
        acc.add_(a_flat.take(a_at + d * R1).double().mul_(b_flat.take(b_at + d * R2).double()))
        acc.copy_(acc.float())
    return acc.float()


def _compact(mask: Tensor) -> tuple[Tensor, Tensor]:
    """The True slots of each head first, in slot order: (index [B, H, K] long, ok [B, H, K] bool),
    K = the most True slots of any head (at least 1)."""
    count = mask.sum(-1)
    K = max(1, int(count.max()))
    order = torch.sort((~mask).long(), dim=-1, stable=True).indices[..., :K]
    return order, torch.arange(K, device=mask.device) < count[..., None]


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
                      coarse: bool | None = None) -> tuple[Tensor, Tensor]:
    """For every evicted slot, its most similar receiving slot of the same chunk (key cosine).

    keys: [B, H, N, D]; evicted, receiving: [B, H, N] bool; chunk_ids: [B, H, N] long
    coarse: search in bfloat16 first, then re-score the candidates in float32 (None: where
            ``coarse_available``, D <= 64 and B * H * E * K >= 2^23 similarities)
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
            bh = row // E
            kn_t = kn.transpose(-1, -2).contiguous()  # [B, H, D, N]: each term one gather
            slot_e = e_order.take(row)
            slot_k = order.take(bh * K + col)
            val = rescore(kn_t, bh * D * N + slot_e, kn_t, bh * D * N + slot_k)
            e_best.view(-1).scatter_reduce_(0, row, val, "amax")
            win = val == e_best.view(-1)[row]
            e_parent.view(-1).scatter_reduce_(0, row[win], col[win], "amin", include_self=False)
    has = e_ok & (e_best > NEG_INF)
    e_parent = torch.where(has, order.gather(-1, e_parent.clamp(0, K - 1)), -1)
    e_best = torch.where(has, e_best, NEG_INF)
    # back to slot order; padding rows of heads with fewer evicted slots write into a trash column
    dest = torch.where(e_ok, e_order, N)
    parent = torch.full((B, H, N + 1), -1, dtype=torch.long, device=device).scatter_(-1, dest, e_parent)
    best = torch.full((B, H, N + 1), NEG_INF, dtype=torch.float32, device=device).scatter_(-1, dest, e_best)
    return parent[..., :N], best[..., :N]


class D2OMerger(_FastD2OMerger):
    """Session 12's merger: ``__call__`` verbatim (the parents' keys by a gather through an
    index expanded over D)."""

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
