"""Proportional attention as transformers attention implementations.

Registered explicitly (``register_attention()``; ``CompressedCache.for_model`` calls it), never
at import time:

    "kvcompress"       backend chosen automatically (FlexAttention on CUDA; on CPU the faster one)
    "kvcompress_flex"  FlexAttention through torch.compile
    "kvcompress_bias"  SDPA with an additive float32 log-size bias

Each is registered with ``sdpa_mask`` as its mask function, so padding reaches the model's mask.
A layer of ``CompressedCache`` puts a ``LayerStep`` into the kwargs dict its attention module
hands to ``cache.update``; that dict is the one the attention function receives. Without a step
(no cache, or a stock cache) the functions behave exactly like transformers' "sdpa".

Paths, per layer and forward:
- prefill of an empty layer (nothing merged yet): stock memory-efficient SDPA with the model's
  causal/padding mask; no [L, N] float bias is ever built for a long prompt;
- otherwise: softmax(q K^T * scale + log s) V over the layer's own slots, causal bottom-right in
  slot space for a multi-token input, GQA by grouping query heads (keys never repeated).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

from ..attention import proportional_attention
from ..validation import check_choice
from .support import ATTN_AUTO, ATTN_BIAS, ATTN_FLEX

STEP_KEY = "kvcompress_step"
BACKENDS = ("auto", "flex", "sdpa")

# signature shared with kvcompress.flex:
#   fn(query [B, Hq, L, D], keys [B, Hkv, N, D], values [B, Hkv, N, Dv], log_sizes [B, Hkv, N],
#      *, scale, causal, use_sizes) -> [B, Hq, L, Dv]
AttentionFn = Callable[..., Tensor]


def _reference_sdpa(query, keys, values, log_sizes, *, scale, causal, use_sizes):
    return proportional_attention(query, keys, values, log_sizes, causal=causal, scale=scale, use_sizes=use_sizes)


def _flex_module():
    try:
        from .. import flex  # noqa: PLC0415 - optional sibling module, imported on first use
    except ImportError:
        return None
    return flex


_RESOLVED: dict[tuple[str, str], AttentionFn] = {}


def resolve_backend(backend: str, device: torch.device) -> AttentionFn:
    """The attention function for ``backend`` ("auto", "flex" or "sdpa") on ``device``."""
    check_choice("backend", backend, BACKENDS)
    key = (backend, torch.device(device).type)
    if key in _RESOLVED:
        return _RESOLVED[key]
    if backend == "sdpa":
        fn = _reference_sdpa  # no import of kvcompress.flex: it pulls in torch.compile (seconds)
    elif backend == "flex":
        flex = _flex_module()
        if flex is None or not hasattr(flex, "flex_proportional_attention"):
            raise ValueError("backend='flex' is invalid: expected kvcompress.flex (FlexAttention) to be "
                             "available; use backend='sdpa' or 'auto'")
        fn = flex.flex_proportional_attention
    else:
        fn = _auto_backend(_flex_module(), torch.device(device))
    _RESOLVED[key] = fn
    return fn


def _auto_backend(flex, device: torch.device) -> AttentionFn:
    if flex is None:
        return _reference_sdpa
    auto = getattr(flex, "auto_proportional_attention", None)
    if auto is not None:
        return auto  # chooses per call: flex on CUDA, on CPU the faster one (probed once per bucket)
    if device.type == "cuda" and hasattr(flex, "flex_proportional_attention"):
        return flex.flex_proportional_attention
    return getattr(flex, "sdpa_proportional_attention", None) or _reference_sdpa


def compile_count() -> int:
    """Graphs compiled so far by the flex kernel (0 while kvcompress.flex was never used)."""
    import sys

    flex = sys.modules.get("kvcompress.flex")  # not imported: nothing was compiled
    if flex is None:
        return 0
    for name in ("compile_count", "get_compile_count"):
        counter = getattr(flex, name, None)
        if callable(counter):
            return int(counter())
        if isinstance(counter, int):
            return counter
    return 0


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


def _make_attention(forced_backend: str | None):
    def kvcompress_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        step = kwargs.pop(STEP_KEY, None)
        if step is None:
            return _stock_sdpa(module, query, key, value, attention_mask, dropout, scaling, kwargs)
        scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
        try:
            if step.can_use_stock(attention_mask, key.shape[2]):
                out, _ = _stock_sdpa(module, query, key, value, attention_mask, dropout, scaling, kwargs)
            else:
                fn = resolve_backend(forced_backend or step.backend, query.device)
                out = fn(query, key, value, step.log_sizes, scale=scale, causal=step.causal,
                         use_sizes=step.use_sizes)
                out = out.transpose(1, 2).contiguous()  # [B, L, Hq, Dv], what the model reshapes
            received = None
            if step.track_attention:
                received = attention_received(query, key, step.log_sizes, scale=scale, causal=step.causal,
                                              use_sizes=step.use_sizes, query_valid=step.query_valid)
        except BaseException:
            step.abort()  # the layers updated in this forward go back to where they were
            raise
        step.finish(query, received)
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
