"""The window-attention scorer before the speed work (issue 16): a [W, N] bias per head and fresh
buffers for every step. Kept verbatim as the reference the in-place version is tested against."""

import math

import torch
from torch import Tensor

from kvcompress.strategies.scorers import REDUCTIONS, query_positions
from kvcompress.types import KVState
from kvcompress.validation import check_choice

_BLOCK_ELEMENTS = 1 << 25


def window_attention(
    state: KVState,
    queries: Tensor,
    scale: float | None = None,
    proportional: bool = True,
    reduce: str = "sum",
) -> Tensor:
    """Attention each slot receives from the captured queries, summed over queries and over the
    query heads of each KV group (reduce="sum"), or averaged over the queries that can see the
    slot (reduce="mean": no bias against the slots inside the window, which fewer queries see).

    state:   keys [B, H, N, D], log_sizes [B, H, N], positions [B, H, N]
    queries: [B, H_q, W, D], the queries of the last W tokens (positions T - W .. T - 1)
    returns  [B, H, N] float32. Each query's softmax runs over the slots it may see (slot
             position <= query position, padding excluded) with log(size) added to the logits
             when ``proportional``; queries on left padding count for nothing.
    """
    check_choice("reduce", reduce, REDUCTIONS)
    keys = state.keys
    B, H, N, D = keys.shape
    Hq, W = queries.shape[1], queries.shape[2]
    G = Hq // H
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    qpos = query_positions(state, W)  # [W]
    valid = state.valid
    bias = state.log_sizes if proportional else torch.zeros_like(state.log_sizes)
    bias = bias.masked_fill(~valid, float("-inf"))  # [B, H, N]
    visible = state.positions[:, :, None, :] <= qpos[None, None, :, None]  # [B, H, W, N]
    bias = bias[:, :, None, :].masked_fill(~visible, float("-inf"))  # [B, H, W, N]
    q_real = (qpos[None, :] >= state.start()[:, None]).float()  # [B, W]
    q = queries.reshape(B, H, G, W, D).float()

    out = torch.zeros(B, H, N, dtype=torch.float32, device=keys.device)
    step = max(1, _BLOCK_ELEMENTS // max(1, B * G * W * N))
    for h0 in range(0, H, step):
        hs = slice(h0, min(H, h0 + step))
        logits = torch.einsum("bhgwd,bhnd->bhgwn", q[:, hs], keys[:, hs].float()) * scale
        logits = logits + bias[:, hs, None]
        probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # a query seeing nothing gives 0
        probs = probs * q_real[:, None, None, :, None]
        out[:, hs] = probs.sum(dim=(2, 3))
    if reduce == "mean":
        seen = (visible & (q_real[:, None, :, None] > 0)).sum(2) * G  # [B, H, N] queries seeing a slot
        out = out / seen.clamp(min=1)
    return out
