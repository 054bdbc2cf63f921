"""``most_similar_kept`` as it was before the bfloat16 coarse search (session 10): float32 products
only, kept verbatim as the reference the coarse search's choices must match (the exact float32
argmax, up to float ties)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kvcompress.strategies.d2o import _BLOCK_ENTRIES, _ROW_BLOCK, _compact, row_max
from kvcompress.types import NEG_INF


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
