"""Proportional attention through FlexAttention (pure torch), with an SDPA path and a chooser.

softmax(q K^T * scale + bias) V over a compressed cache: a slot standing for s tokens gets
bias log s (its ``log_sizes``); padding slots carry -inf and are never attended.

Three modules, each usable on its own:

- ``kvcompress.flex.score_mods``: score_mod / mask_mod factories (``log_size_bias``,
  ``padding_mask``, ``bottom_right_causal``, ``compose``, ``proportional_score_mod``, ...);
- ``kvcompress.flex.kernels``: ``flex_proportional_attention`` (one torch.compile'd
  flex_attention per signature, ``compile_count()``) and ``sdpa_proportional_attention``;
- ``kvcompress.flex.chooser``: ``BackendChooser`` (SDPA on CUDA, on CPU the faster one by a
  probe); each cache holds its own, the functions here use a default one.
"""

from .chooser import (
    BACKENDS, DEFAULT, PROBE_REPEATS, BackendChooser, BackendDecision, auto_proportional_attention,
    backend_decisions, choose_backend, clear_backend_decisions, get_backend_override, set_backend,
)
from .kernels import (
    CPU_MIN_HEAD_DIM, compile_count, flex_proportional_attention, reset_compile_count,
    sdpa_proportional_attention,
)
from .score_mods import (
    MaskMod, ScoreMod, bottom_right_causal, bottom_right_causal_mask, causal_block_mask, compose,
    log_size_bias, padding_mask, proportional_score_mod,
)

__all__ = [
    "ScoreMod", "MaskMod", "log_size_bias", "padding_mask", "bottom_right_causal", "compose",
    "proportional_score_mod", "bottom_right_causal_mask", "causal_block_mask",
    "flex_proportional_attention", "sdpa_proportional_attention", "auto_proportional_attention",
    "BackendChooser", "DEFAULT", "choose_backend", "set_backend", "get_backend_override", "backend_decisions",
    "clear_backend_decisions", "compile_count", "reset_compile_count", "BACKENDS",
    "BackendDecision", "CPU_MIN_HEAD_DIM", "PROBE_REPEATS",
]
