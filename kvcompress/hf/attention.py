"""Proportional attention as transformers attention implementations.

Registered explicitly (``register_attention()``; ``CompressedCache.for_model`` calls it), never
at import time:

    "kvcompress"       backend chosen by the cache (SDPA on CUDA; on CPU the faster one)
    "kvcompress_flex"  FlexAttention through torch.compile
    "kvcompress_bias"  SDPA with an additive float32 log-size bias

Each is registered with ``sdpa_mask`` as its mask function, so padding reaches the model's mask.

The attention function only attends and records. For a layer of a ``CompressedCache`` the cache
hands it an ``AttentionRequest`` (in the kwargs dict the attention module passes to
``cache.update``, or, for models whose attention passes no kwargs there, found by the keys the
cache returned). The request says which keys' biases to add, whether the stock kernel is exact,
and what to record (the queries, the attention each slot received); the function fills it in and
returns. It never calls back into the cache: the cache reads the request later and decides
whether to compress. Without a request (no cache, a stock cache, a sliding-window layer) the
functions behave exactly like transformers' "sdpa".

Paths, per layer and forward:
- prefill of an empty layer (nothing merged yet): stock memory-efficient SDPA with the model's
  causal/padding mask; no [L, N] float bias is ever built for a long prompt;
- otherwise: softmax(q K^T * scale + bias) V over the layer's own slots (bias = log_sizes),
  causal bottom-right in slot space for a multi-token input, GQA by grouping query heads.
"""

from __future__ import annotations

import math
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from .support import ATTN_AUTO, ATTN_BIAS, ATTN_FLEX

REQUEST_KEY = "kvcompress_request"

# the cache whose forward is running (set by a bound cache's forward pre-hook, reset by its
# post-hook): lets the attention function find the request of models whose attention module
# does not hand its kwargs to cache.update (GPT-NeoX)
ACTIVE_CACHE: ContextVar = ContextVar("kvcompress_active_cache", default=None)


@dataclass
class AttentionRequest:
    """One layer's attention in one forward: what to attend with and what to record.

    keys:        [B, H, N_view, D] the view the cache returned (identifies the request)
    log_sizes:   [B, H, N_view] float32 per-slot bias (-inf = padding / unused)
    fresh:       the layer was empty: a prefill over nothing merged
    compressed:  slots != tokens (merged or compacted) before this forward's tokens
    causal:      bottom-right causal in slot space (multi-token inputs)
    use_sizes:   add the bias (False: proportional attention off, padding still masked)
    attend:      fn(query, keys, values, log_sizes, *, scale, causal, use_sizes, backend) -> out,
                 the cache's backend chooser
    query_window / reference_queries: queries to keep (see ``record``)
    track_attention: compute the attention each slot receives
    query_valid: [B, q] bool or None (False for padding queries)
    seq_start:   [B] long or None, first real token of each row (for the reference stride)
    """

    keys: Tensor
    log_sizes: Tensor
    fresh: bool
    compressed: bool
    causal: bool
    use_sizes: bool
    attend: Callable[..., Tensor]
    query_window: int = 0
    reference_queries: int = 0
    track_attention: bool = False
    query_valid: Tensor | None = None
    seq_start: Tensor | None = None
    # filled in by the attention function
    done: bool = False
    queries: Tensor | None = None  # [B, Hq, min(W, q), D]
    reference: Tensor | None = None  # [B, Hq, R, D]
    received: Tensor | None = None  # [B, H, N_view] float32

    def stock_is_exact(self, attention_mask, num_keys: int) -> bool:
        """Stock SDPA with the model's mask is exact when no slot is merged and the mask was
        built for exactly this layer's slots."""
        if self.fresh:
            return True
        return (not self.compressed and self.causal and isinstance(attention_mask, Tensor)
                and attention_mask.dim() == 4 and attention_mask.shape[-1] == num_keys)

    def record(self, query: Tensor, received: Tensor | None) -> None:
        """Keep what was asked for of this forward's queries [B, Hq, q, D] (rotated, unscaled)."""
        q = query.detach()
        if self.query_window > 0:
            self.queries = q[:, :, -self.query_window:].contiguous()
        if self.reference_queries > 0:
            self.reference = strided_queries(q, self.reference_queries, self.seq_start)
        self.received = received
        self.done = True


def strided_queries(query: Tensor, count: int, seq_start: Tensor | None) -> Tensor:
    """[B, Hq, R, D]: R of the L queries strided evenly over each row's real tokens, the last
    one included (rows shorter than R repeat queries). query: [B, Hq, L, D]."""
    B, Hq, L, D = query.shape
    device = query.device
    start = torch.zeros(B, dtype=torch.long, device=device) if seq_start is None else seq_start.to(device)
    real = (L - start).clamp(min=1).to(torch.float64)  # [B]
    frac = (torch.linspace(0.0, 1.0, count, dtype=torch.float64, device=device) if count > 1
            else torch.ones(1, dtype=torch.float64, device=device))
    idx = (start[:, None] + torch.round(frac[None, :] * (real[:, None] - 1)).long()).clamp(0, L - 1)  # [B, R]
    return query.gather(2, idx[:, None, :, None].expand(B, Hq, count, D)).contiguous()


# ---------------------------------------------------------------------------- statistics
def attention_received(
    query: Tensor, keys: Tensor, log_sizes: Tensor, *, scale: float, causal: bool, use_sizes: bool,
    query_valid: Tensor | None = None, max_elements: int = 1 << 24,
) -> Tensor:
    """[B, Hkv, N] float32: attention probability each slot receives, summed over the query
    heads of its KV group and over the (valid) queries.

    query: [B, Hq, L, D]; keys: [B, Hkv, N, D]; log_sizes: [B, Hkv, N];
    query_valid: [B, L] bool or None. Queries are processed in chunks of at most
    ``max_elements`` logits, so a long prefill never materialises [L, N] for all heads at once.
    """
    B, Hq, L, D = query.shape
    Hkv, N = keys.shape[1], keys.shape[2]
    G = Hq // Hkv
    q = query.reshape(B, Hkv, G, L, D)
    k = keys.float()
    bias = log_sizes.float() if use_sizes else torch.where(log_sizes == float("-inf"), float("-inf"), 0.0)
    out = torch.zeros(B, Hkv, N, dtype=torch.float32, device=keys.device)
    step = max(1, max_elements // max(1, B * Hq * N))
    j = torch.arange(N, device=keys.device)
    for start in range(0, L, step):
        stop = min(L, start + step)
        # causal: slots past the chunk's last query are masked for all of its queries, so they
        # are left out of the product (a long prefill's chunks then cost a triangle, not a square)
        n = min(N, N - L + stop) if causal else N
        if n <= 0:
            continue  # every query of the chunk sees no slot: a fully masked row receives 0
        logits = torch.einsum("bhgld,bhnd->bhgln", q[:, :, :, start:stop].float(), k[:, :, :n]) * scale
        logits = logits + bias[:, :, None, None, :n]
        if causal:
            i = torch.arange(start, stop, device=keys.device)
            future = j[None, :n] > (N - L + i)[:, None]  # [l, n], bottom-right in slot space
            logits = logits.masked_fill(future, float("-inf"))
        probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # a fully masked row gives 0
        if query_valid is not None:
            probs = probs * query_valid[:, None, None, start:stop, None].to(probs.dtype)
        out[:, :, :n] += probs.sum(dim=(2, 3))
    return out


# ---------------------------------------------------------------------------- the attention functions
def _stock_sdpa(module, query, key, value, attention_mask, dropout, scaling, kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


def _request_for(key: Tensor, kwargs: dict) -> AttentionRequest | None:
    request = kwargs.pop(REQUEST_KEY, None)
    if request is not None:
        return request
    cache = ACTIVE_CACHE.get()
    return None if cache is None else cache.request_for(key)


def _make_attention(forced_backend: str | None):
    def kvcompress_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        request = _request_for(key, kwargs)
        if request is None:
            return _stock_sdpa(module, query, key, value, attention_mask, dropout, scaling, kwargs)
        scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
        if request.stock_is_exact(attention_mask, key.shape[2]):
            out, _ = _stock_sdpa(module, query, key, value, attention_mask, dropout, scaling, kwargs)
        else:
            out = request.attend(query, key, value, request.log_sizes, scale=scale, causal=request.causal,
                                 use_sizes=request.use_sizes, backend=forced_backend)
            out = out.transpose(1, 2).contiguous()  # [B, L, Hq, Dv], what the model reshapes
        received = None
        if request.track_attention:
            received = attention_received(query, key, request.log_sizes, scale=scale, causal=request.causal,
                                          use_sizes=request.use_sizes, query_valid=request.query_valid)
        request.record(query, received)
        return out, None

    kvcompress_attention.__name__ = f"kvcompress_attention_{forced_backend or 'auto'}"
    return kvcompress_attention


ATTENTION_FUNCTIONS = {
    ATTN_AUTO: _make_attention(None),
    ATTN_FLEX: _make_attention("flex"),
    ATTN_BIAS: _make_attention("sdpa"),
}


def register_attention() -> tuple[str, ...]:
    """Register the kvcompress attention implementations with transformers (idempotent).

    Call before ``from_pretrained(..., attn_implementation="kvcompress")`` or use
    ``model.set_attn_implementation("kvcompress")`` afterwards.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    for name, fn in ATTENTION_FUNCTIONS.items():
        AttentionInterface.register(name, fn)
        AttentionMaskInterface.register(name, sdpa_mask)
    return tuple(ATTENTION_FUNCTIONS)
