"""Outlier heads: the (layer, KV head) pairs whose compression perturbs attention most keep their
full cache (CentroidKV keeps about 4% of heads uncompressed, found by offline calibration).

Calibration, per layer (pure torch; ``kvcompress.hf.calibrate`` gets keys, values and queries from
a real model): compress everything before the last W tokens with the pipeline, append those W
tokens raw, and compare the attention output of their W queries over the compressed cache with
the output over the full cache. The score of a KV head is the relative error
||out_c - out_f|| / ||out_f|| over its query heads, the W queries and the head dimension.

The result is saved as JSON that a config can point to:

    {"full_heads": [[layer, head], ...], "scores": [[...], ...], "fraction": 0.04, ...}

and ``with_outlier_heads(config, path)`` returns the config with ``full_heads`` set.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Mapping

import torch
from torch import Tensor

from .attention import proportional_attention
from .config import PipelineConfig, as_config
from .decode import append_tokens
from .pipeline import Pipeline
from .types import KVState
from .validation import check_int, check_range, require

DEFAULT_FRACTION = 0.04


def head_errors(
    pipeline: Pipeline,
    keys: Tensor,
    values: Tensor,
    queries: Tensor,
    window: int,
    token_ids: Tensor | None = None,
    vocab=None,
    scale: float | None = None,
) -> Tensor:
    """Relative attention-output error per KV head when the context before the last ``window``
    tokens is compressed by ``pipeline`` (its full_heads are ignored: every head is measured).

    keys, values: [B, H, T, D]  one layer's cache (after RoPE)
    queries:      [B, Hq, W, D] the queries of the last W = window tokens (after RoPE)
    token_ids:    [B, T] or None (text-aware chunkers need them, and ``vocab``)
    returns       [H] float32, mean over the batch
    """
    B, H, T, D = keys.shape
    check_int("window", window, 1)
    require(window < T, "window", window, f"fewer than the {T} tokens of the layer")
    require(tuple(queries.shape[:1]) == (B,) and queries.shape[2] == window and queries.shape[1] % H == 0,
            "queries", tuple(queries.shape), f"shape ({B}, a multiple of {H}, {window}, {D})")
    ctx = T - window
    prefix = KVState.from_raw(keys[:, :, :ctx], values[:, :, :ctx],
                              None if token_ids is None else token_ids[:, :ctx], vocab=vocab)
    compressed, _ = pipeline.compress(prefix)
    tail_ids = None if token_ids is None else token_ids[:, ctx:]
    compressed = append_tokens(compressed, keys[:, :, ctx:], values[:, :, ctx:], tail_ids)
    full = proportional_attention(queries, keys, values, torch.zeros(B, H, T, device=keys.device),
                                  causal=True, scale=scale)
    approx = proportional_attention(queries, compressed.keys, compressed.values, compressed.log_sizes,
                                    causal=True, scale=scale)
    G = queries.shape[1] // H
    diff = (approx.float() - full.float()).reshape(B, H, G * window * D)
    ref = full.float().reshape(B, H, G * window * D)
    return (diff.norm(dim=-1) / ref.norm(dim=-1).clamp(min=1e-12)).mean(0)


def select_outlier_heads(scores: Tensor, fraction: float = DEFAULT_FRACTION) -> list[tuple[int, int]]:
    """The ceil(fraction * L * H) heads with the largest scores, as sorted (layer, head) pairs.

    scores: [L, H] float
    """
    require(scores.dim() == 2, "scores", tuple(scores.shape), "a [layers, kv_heads] tensor")
    check_range("fraction", fraction, 0.0, 1.0)
    L, H = scores.shape
    count = min(L * H, math.ceil(fraction * L * H - 1e-9))
    if count == 0:
        return []
    top = scores.flatten().float().topk(count).indices
    return sorted((int(i) // H, int(i) % H) for i in top)


def outlier_report(scores: Tensor, fraction: float = DEFAULT_FRACTION, **meta) -> dict:
    """The JSON-ready calibration result: full_heads, per-head scores, fraction and ``meta``."""
    heads = select_outlier_heads(scores, fraction)
    return {"full_heads": [list(p) for p in heads], "scores": scores.float().tolist(),
            "fraction": fraction, **meta}


def save_outlier_heads(path: str | Path, report: Mapping) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(report), indent=2))
    return path


def load_outlier_heads(source: str | Path | Mapping) -> tuple[tuple[int, int], ...]:
    """The full_heads of a calibration JSON file (or of its parsed dict)."""
    data = source if isinstance(source, Mapping) else json.loads(Path(source).read_text())
    require(isinstance(data, Mapping) and "full_heads" in data, "outlier heads", str(source)[:80],
            "a JSON object with a 'full_heads' list of [layer, head] pairs")
    # PipelineConfig validates the pairs
    return PipelineConfig(full_heads=data["full_heads"]).full_heads


def with_outlier_heads(config: PipelineConfig | Mapping | str, source: str | Path | Mapping,
                       **overrides) -> PipelineConfig:
    """``config`` (a preset name, dict, JSON path or config) with full_heads from a calibration file."""
    return as_config(config, **overrides).replace(full_heads=load_outlier_heads(source))
