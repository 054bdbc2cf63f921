"""Proportional attention, reference implementation on SDPA (pure torch, no transformers).

A slot standing for s tokens gets log(s) added to its logit before the softmax, which equals
attending over the s tokens if they all had the slot's key and value. Padding slots have
log-size -inf and are never attended.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .types import KVState
from .validation import require


def proportional_bias(
    log_sizes: Tensor, q_len: int, groups: int, causal: bool = True, use_sizes: bool = True,
) -> Tensor:
    """Additive float32 bias [B, H_kv, G * q_len, N] for queries laid out as [B, H_kv, G * q_len, D].

    log_sizes: [B, H_kv, N] (-inf = padding)
    causal:    the q_len new tokens are the last q_len slots; query i sees slots
               < N - q_len + i + 1 (bottom-right alignment in slot space)
    use_sizes: False drops the log-size term but still masks padding (ablation "proportional off")
    """
    B, H, N = log_sizes.shape
    bias = log_sizes.float() if use_sizes else torch.where(
        torch.isinf(log_sizes) & (log_sizes < 0), float("-inf"), 0.0).float()
    bias = bias[:, :, None, :].expand(B, H, q_len, N)
    if causal and q_len > 1:
        i = torch.arange(q_len, device=log_sizes.device)[:, None]
        j = torch.arange(N, device=log_sizes.device)[None, :]
        future = j > (N - q_len + i)  # [q_len, N]
        bias = bias.masked_fill(future, float("-inf"))
    return bias[:, :, None].expand(B, H, groups, q_len, N).reshape(B, H, groups * q_len, N)


def native_dtype(query: Tensor) -> torch.dtype:
    """The dtype ``proportional_attention`` computes in by default: the query's own for float16 /
    bfloat16 on CUDA, float32 elsewhere.

    Why: on CUDA, SDPA over float32 inputs with a float mask runs a memory-efficient kernel that
    does not split the keys, so one decode query over 32k slots took 3.6 ms against 0.044 ms in
    bfloat16 (H200, torch 2.11; benchmarks/results/gpu_decode_probe.json). The bias then carries
    the dtype's rounding (relative 2^-9 in bfloat16: about 0.3% of a slot's mass at log size 1.4).
    On CPU the float32 path is the faster one and stays exact.
    """
    if query.device.type == "cuda" and query.dtype in (torch.float16, torch.bfloat16):
        return query.dtype
    return torch.float32


def proportional_attention(
    query: Tensor,
    keys: Tensor,
    values: Tensor,
    log_sizes: Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
    use_sizes: bool = True,
    extra_mask: Tensor | None = None,
    compute_dtype: torch.dtype | None = None,
) -> Tensor:
    """softmax(q K^T * scale + log s) V, GQA-aware without repeating keys.

    query:         [B, H_q, L, D]
    keys:          [B, H_kv, N, D]    H_q must be a multiple of H_kv
    values:        [B, H_kv, N, Dv]
    log_sizes:     [B, H_kv, N]
    extra_mask:    [B, L, N] bool or None (False = masked), e.g. a padding mask
    compute_dtype: float32 (inputs upcast, float32 bias), or float16 / bfloat16 (SDPA in that
                   dtype, the bias rounded to it); None = ``native_dtype(query)``
    returns        [B, H_q, L, Dv] in the query's dtype
    """
    B, Hq, L, D = query.shape
    Hkv, N = keys.shape[1], keys.shape[2]
    require(Hq % Hkv == 0, "query heads", Hq, f"a multiple of the {Hkv} key/value heads")
    require(tuple(log_sizes.shape) == (B, Hkv, N), "log_sizes", tuple(log_sizes.shape), f"shape {(B, Hkv, N)}")
    G = Hq // Hkv
    compute_dtype = native_dtype(query) if compute_dtype is None else compute_dtype
    require(compute_dtype in (torch.float32, torch.float16, torch.bfloat16), "compute_dtype", compute_dtype,
            "torch.float32, torch.float16 or torch.bfloat16")
    if compute_dtype != torch.float32:
        bias = proportional_bias(log_sizes, L, 1, causal=causal, use_sizes=use_sizes)  # [B, H_kv, L, N]
        if extra_mask is not None:
            bias = bias.masked_fill(~extra_mask[:, None], float("-inf"))
        # one mask row per query head (h reads KV head h // G, as enable_gqa does)
        mask = bias.to(compute_dtype).repeat_interleave(G, dim=1)  # [B, H_q, L, N]
        out = F.scaled_dot_product_attention(query.to(compute_dtype), keys.to(compute_dtype),
                                             values.to(compute_dtype), attn_mask=mask, scale=scale,
                                             enable_gqa=G > 1)
        return out.to(query.dtype)
    q = query.reshape(B, Hkv, G * L, D).float()  # heads of one group share their KV head
    bias = proportional_bias(log_sizes, L, G, causal=causal, use_sizes=use_sizes)
    if extra_mask is not None:
        m = extra_mask[:, None, None].expand(B, Hkv, G, L, N).reshape(B, Hkv, G * L, N)
        bias = bias.masked_fill(~m, float("-inf"))
    out = F.scaled_dot_product_attention(q, keys.float(), values.float(), attn_mask=bias, scale=scale)
    return out.reshape(B, Hq, L, -1).to(query.dtype)


def expand_state(state: KVState) -> tuple[Tensor, Tensor, Tensor]:
    """The "expanded" cache: every slot repeated size times (sizes must be whole numbers).

    returns keys, values [B, H, T, D] and log_sizes [B, H, T] (0 for tokens, -inf for the padding
    of rows that cover fewer tokens). Attention over it must equal proportional attention over
    the merged state.
    """
    sizes = torch.round(state.log_sizes.exp()).long()  # [B, H, N], 0 for padding
    B, H, N, D = state.keys.shape
    T = int(sizes.sum(-1).max())
    out_k = state.keys.new_zeros(B, H, T, D)
    out_v = state.values.new_zeros(B, H, T, state.values.shape[-1])
    out_ls = torch.full((B, H, T), float("-inf"), device=state.keys.device)
    for b in range(B):
        for h in range(H):
            reps = sizes[b, h]
            k = state.keys[b, h].repeat_interleave(reps, dim=0)
            out_k[b, h, : k.shape[0]] = k
            out_v[b, h, : k.shape[0]] = state.values[b, h].repeat_interleave(reps, dim=0)
            out_ls[b, h, : k.shape[0]] = 0.0
    return out_k, out_v, out_ls
