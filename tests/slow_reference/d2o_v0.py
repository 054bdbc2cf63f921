"""The D2O nearest-kept-slot search before the speed work (issue 16): every slot against every
kept one, masked by chunk. Kept verbatim as the reference the fast version is tested against."""

import torch
import torch.nn.functional as F
from torch import Tensor

from kvcompress.types import NEG_INF

_ROW_BLOCK = 1024


def most_similar_kept(keys: Tensor, evicted: Tensor, receiving: Tensor, chunk_ids: Tensor) -> tuple[Tensor, Tensor]:
    """For every evicted slot, its most similar receiving slot of the same chunk (key cosine).

    keys: [B, H, N, D]; evicted, receiving: [B, H, N] bool; chunk_ids: [B, H, N] long
    returns (parent [B, H, N] long slot or -1, similarity [B, H, N] float32, -inf where none);
            ties go to the earlier slot. Memory: [B, H, block, K] similarities at a time.
    """
    B, H, N, D = keys.shape
    kn = F.normalize(keys.float(), dim=-1)
    count = receiving.sum(-1)
    K = max(1, int(count.max()))
    order = torch.sort((~receiving).long(), dim=-1, stable=True).indices[..., :K]  # receiving first, in slot order
    k_ok = torch.arange(K, device=keys.device) < count[..., None]  # [B, H, K]
    k_keys = kn.gather(2, order[..., None].expand(B, H, K, D))
    k_chunk = torch.where(k_ok, chunk_ids.gather(-1, order), -2)
    parent = torch.full((B, H, N), -1, dtype=torch.long, device=keys.device)
    best = torch.full((B, H, N), NEG_INF, dtype=torch.float32, device=keys.device)
    for n0 in range(0, N, _ROW_BLOCK):
        rows = slice(n0, min(N, n0 + _ROW_BLOCK))
        sims = torch.einsum("bhnd,bhkd->bhnk", kn[:, :, rows], k_keys)
        same = k_chunk[:, :, None, :] == chunk_ids[:, :, rows, None]
        sims = sims.masked_fill(~same, NEG_INF)
        val, idx = sims.max(-1)
        has = evicted[:, :, rows] & (val > NEG_INF)
        parent[:, :, rows] = torch.where(has, order.gather(-1, idx), -1)
        best[:, :, rows] = torch.where(has, val, NEG_INF)
    return parent, best
