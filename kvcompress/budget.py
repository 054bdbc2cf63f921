"""The one budget rule: how many slots a head may keep.

Every place that needs the budget (``Pipeline.target_slots``, ``DecodeCompressor``, the cache's
cheap "may this layer exceed its budget" check) calls ``target_slots``, so they cannot disagree.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .validation import require

_EPS = 1e-9  # keep_ratio * tokens that lands a hair under an integer still counts as that integer


def target_slots(real_tokens, keep_ratio: float | None, max_slots: int | None):
    """Slots a head may keep: ``max(1, floor(real_tokens * keep_ratio))`` or ``max_slots``.

    real_tokens: an int, or a [B] long tensor (tokens seen per row, left padding excluded)
    keep_ratio / max_slots: exactly one set (a PipelineConfig's budget)
    returns      the same kind as ``real_tokens`` (int, or [B] long on its device)
    """
    require((keep_ratio is None) != (max_slots is None), "keep_ratio/max_slots", (keep_ratio, max_slots),
            "exactly one of them set (the other None)")
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


__all__ = ["target_slots"]
