"""The one budget rule: how many slots a head may keep.

Every place that needs the budget (``Pipeline.target_slots``, ``DecodeCompressor``, the cache's
cheap "may this layer exceed its budget" check) calls ``target_slots``, so they cannot disagree.

The budget is the cache's size: ``keep_ratio`` of the tokens seen, per head, on average over the
layers. A cross-layer guard may give some layers more and the others less (``LayerBudgetGuard``);
each layer's state then carries its factor in ``extras[LAYER_SCALE]``, the factors averaging 1
over the layers, and every budget check of that layer reads it.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .validation import require

_EPS = 1e-9  # keep_ratio * tokens that lands a hair under an integer still counts as that integer
# extras key of a layer's state: [B] float, the layer's budget relative to an even split over the layers
# (a cross-layer guard's ``layer_scale``, written at the first compression and carried from then on)
LAYER_SCALE = "layer_budget_scale"


def target_slots(real_tokens, keep_ratio: float | None, max_slots: int | None, scale: Tensor | None = None):
    """Slots a head may keep: ``max(1, floor(real_tokens * keep_ratio))`` or ``max_slots``.

    real_tokens: an int, or a [B] long tensor (tokens seen per row, left padding excluded)
    keep_ratio / max_slots: exactly one set (a PipelineConfig's budget)
    scale:       None, or a [B] float tensor (with a tensor ``real_tokens``): this layer's share of
                 the cache's budget relative to an even split (``LAYER_SCALE``), so the budget is
                 ``max(1, floor(real_tokens * keep_ratio * scale))`` or ``floor(max_slots * scale)``
    returns      the same kind as ``real_tokens`` (int, or [B] long on its device)
    """
    require((keep_ratio is None) != (max_slots is None), "keep_ratio/max_slots", (keep_ratio, max_slots),
            "exactly one of them set (the other None)")
    if scale is not None:
        require(isinstance(real_tokens, Tensor) and isinstance(scale, Tensor) and scale.shape == real_tokens.shape,
                "scale", tuple(getattr(scale, "shape", ())), "a [B] tensor beside a [B] tensor of token counts")
        factor = scale.to(device=real_tokens.device, dtype=torch.float64)
        if keep_ratio is None:
            return torch.floor(factor * int(max_slots) + _EPS).long().clamp(min=1)
        return torch.floor(real_tokens.to(torch.float64) * keep_ratio * factor + _EPS).long().clamp(min=1)
    if isinstance(real_tokens, Tensor):
        if keep_ratio is None:
            return torch.full_like(real_tokens, int(max_slots), dtype=torch.long)
        real = real_tokens.to(torch.float64)
        return torch.floor(real * keep_ratio + _EPS).long().clamp(min=1)
    require(isinstance(real_tokens, int) and not isinstance(real_tokens, bool), "real_tokens", real_tokens,
            "an int or a [B] tensor of token counts")
    if keep_ratio is None:
        return int(max_slots)
    return max(1, math.floor(real_tokens * keep_ratio + _EPS))


def smallest_share(limit: int, share: float | None) -> int:
    """An int budget ``limit`` (an even split's, the smallest row's) under a layer's share of the
    budget (the smallest row's factor, or None): the cheap per-step checks' lower bound."""
    return limit if share is None else max(1, math.floor(limit * share))


__all__ = ["LAYER_SCALE", "smallest_share", "target_slots"]
