"""FlexAttention score_mod / mask_mod factories for proportional attention (attention-gym style).

Closures with a stable ``__name__``: ``log_size_bias``, ``padding_mask``, ``bottom_right_causal``,
``compose`` and ``proportional_score_mod`` (all three in one). Pass them to
``torch.nn.attention.flex_attention.flex_attention(..., enable_gqa=True)``: the query head h reads
the log-sizes (the per-slot bias) of its KV head ``h // groups``, so keys are never repeated.
``bottom_right_causal_mask`` / ``causal_block_mask`` give the same causality as a mask_mod /
BlockMask for callers who want block sparsity on long prefills.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from ..validation import require

ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
NEG_INF = float("-inf")


def _named(fn, name: str):
    fn.__name__ = fn.__qualname__ = name
    return fn


def _as_offset(offset: int | Tensor, device=None) -> Tensor:
    if isinstance(offset, Tensor):
        require(offset.dim() == 0 and not offset.is_floating_point(), "offset",
                tuple(offset.shape), "a 0-d integer tensor or an int")
        return offset
    require(isinstance(offset, int) and not isinstance(offset, bool), "offset", offset,
            "a 0-d integer tensor or an int")
    return torch.tensor(offset, dtype=torch.int64, device=device)


def log_size_bias(log_sizes: Tensor, groups: int = 1) -> ScoreMod:
    """score + log_sizes[b, h // groups, kv_idx].

    log_sizes: [B, H_kv, N] float32 (-inf = padding slot, which then gets weight 0)
    groups:    query heads per KV head (H_q // H_kv); with flex_attention(enable_gqa=True) h is
               the query head
    """
    def bias(score, b, h, q_idx, kv_idx):
        return score + log_sizes[b, h // groups, kv_idx]
    return _named(bias, "log_size_bias")


def padding_mask(log_sizes: Tensor, groups: int = 1) -> ScoreMod:
    """score, or -inf where log_sizes[b, h // groups, kv_idx] is -inf (sizes ignored otherwise).

    log_sizes: [B, H_kv, N]
    """
    def mask(score, b, h, q_idx, kv_idx):
        return torch.where(log_sizes[b, h // groups, kv_idx] == NEG_INF, NEG_INF, score)
    return _named(mask, "padding_mask")


def bottom_right_causal(offset: int | Tensor, device=None) -> ScoreMod:
    """-inf where kv_idx > q_idx + offset.

    For q_len new tokens that are the last q_len of N slots, offset = N - q_len: query i sees
    slots < N - q_len + i + 1 (bottom-right alignment in slot space). offset is kept as a 0-d
    tensor (an int is converted, on ``device``) so a change of value never recompiles; give
    the attention's device (or a tensor already there).
    """
    off = _as_offset(offset, device)

    def causal(score, b, h, q_idx, kv_idx):
        return torch.where(kv_idx <= q_idx + off, score, NEG_INF)
    return _named(causal, "bottom_right_causal")


def compose(*score_mods: ScoreMod) -> ScoreMod:
    """Apply score_mods left to right: compose(f, g)(s, ...) = g(f(s, ...), ...)."""
    require(len(score_mods) > 0 and all(callable(m) for m in score_mods), "score_mods",
            score_mods, "one or more callables (score, b, h, q_idx, kv_idx) -> score")
    mods = tuple(score_mods)

    def composed(score, b, h, q_idx, kv_idx):
        for mod in mods:
            score = mod(score, b, h, q_idx, kv_idx)
        return score
    return _named(composed, "compose(" + ",".join(m.__name__ for m in mods) + ")")


def proportional_score_mod(
    log_sizes: Tensor, groups: int = 1, offset: int | Tensor | None = None, use_sizes: bool = True,
) -> ScoreMod:
    """The full proportional-attention score_mod: size bias (or padding mask) then causality.

    log_sizes: [B, H_kv, N]
    offset:    N - q_len for bottom-right causality (an int goes to log_sizes' device), None
               for none
    use_sizes: False keeps only the padding mask (ablation "proportional off")
    """
    first = log_size_bias(log_sizes, groups) if use_sizes else padding_mask(log_sizes, groups)
    if offset is None:
        return first
    return compose(first, bottom_right_causal(offset, log_sizes.device))


def bottom_right_causal_mask(offset: int | Tensor, device=None) -> MaskMod:
    """mask_mod twin of ``bottom_right_causal``: True where kv_idx <= q_idx + offset."""
    off = _as_offset(offset, device)

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + off
    return _named(causal, "bottom_right_causal_mask")


def causal_block_mask(q_len: int, kv_len: int, device="cpu", block_size: int = 128) -> BlockMask:
    """A BlockMask (broadcast over batch and heads) for bottom-right causality, q_len <= kv_len.

    For callers of flex_attention with these score_mods who want flex to skip fully masked
    blocks on long multi-token inputs (``flex_proportional_attention`` takes none: a BlockMask
    carries its lengths as ints, which would specialise the compiled graph per length, and it
    applies causality in the score_mod). Built eagerly (O(q_len * kv_len) work): build it once
    per forward, not per layer.
    """
    require(isinstance(q_len, int) and 1 <= q_len <= kv_len, "q_len", q_len,
            f"an integer in [1, kv_len={kv_len}]")
    return create_block_mask(bottom_right_causal_mask(kv_len - q_len, device), None, None, q_len, kv_len,
                             device=device, BLOCK_SIZE=block_size)

