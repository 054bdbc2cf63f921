"""Outlier-head calibration on a transformers model (the pure-torch part is kvcompress.outliers).

    from kvcompress.hf.calibrate import calibrate_outlier_heads
    report = calibrate_outlier_heads(model, tokenizer, text, "centroidkv", path="outliers.json")
    cfg = kvcompress.outliers.with_outlier_heads("centroidkv", "outliers.json")

One plain prefill with a transformers ``DynamicCache`` gives every layer's keys and values (after
RoPE). Queries are not cached: a forward pre-hook on each attention module keeps the hidden states
and rotary embeddings of the last W tokens and the queries are recomputed with the module's own
q_proj (and q_norm, where the family has one) and its family's ``apply_rotary_pos_emb``. A hook on
o_proj keeps the model's own attention output for those W tokens, and the recomputed queries must
reproduce it over the full cache: a model family that builds queries differently fails loudly
instead of calibrating on wrong queries.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import Tensor

from ..attention import proportional_attention
from ..config import PipelineConfig, as_config
from ..outliers import DEFAULT_FRACTION, head_errors, outlier_report, save_outlier_heads
from ..pipeline import Pipeline
from ..validation import check_int, require

QUERY_CHECK_TOL = 1e-3  # relative error allowed between recomputed and model attention outputs


def _attention_modules(model) -> list:
    """The self-attention module of every decoder layer, in layer order."""
    mods = [m for m in model.modules() if hasattr(m, "q_proj") and hasattr(m, "layer_idx")]
    require(len(mods) > 0, "model", type(model).__name__,
            "a decoder with attention modules that have q_proj and layer_idx (Llama-family)")
    return sorted(mods, key=lambda m: m.layer_idx)


def _rotary(module):
    family = sys.modules.get(type(module).__module__)
    fn = getattr(family, "apply_rotary_pos_emb", None)
    if fn is None:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as fn
    return fn


def _recompute_queries(module, hidden: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """hidden: [B, W, hidden] -> queries [B, Hq, W, D] after RoPE, as the module computes them."""
    B, W, _ = hidden.shape
    q = module.q_proj(hidden).view(B, W, -1, module.head_dim)
    if hasattr(module, "q_norm"):
        q = module.q_norm(q)
    q = q.transpose(1, 2)
    q, _ = _rotary(module)(q, q, cos, sin)
    return q


@torch.inference_mode()
def collect_layers(model, input_ids: Tensor, window: int) -> list[tuple[Tensor, Tensor, Tensor, Tensor]]:
    """Prefill ``input_ids`` with a plain DynamicCache.

    input_ids: [B, T] long (no padding)
    returns    per layer (keys [B, H, T, D], values [B, H, T, D], queries [B, Hq, W, D] of the last
               W = window tokens, the model's attention output [B, Hq, W, D] for those tokens)
    """
    from transformers import DynamicCache

    mods = _attention_modules(model)
    captured: dict[int, dict] = {m.layer_idx: {} for m in mods}
    handles = []

    def pre_hook(module, args, kwargs):
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        cos, sin = kwargs["position_embeddings"] if "position_embeddings" in kwargs else args[1]
        captured[module.layer_idx].update(hidden=hidden[:, -window:], cos=cos[..., -window:, :],
                                          sin=sin[..., -window:, :])

    def o_hook(layer_idx):
        def hook(module, args):
            x = args[0][:, -window:]  # [B, W, Hq * D]: attention output before o_proj
            captured[layer_idx]["out"] = x
        return hook

    try:
        for m in mods:
            handles.append(m.register_forward_pre_hook(pre_hook, with_kwargs=True))
            handles.append(m.o_proj.register_forward_pre_hook(o_hook(m.layer_idx)))
        cache = DynamicCache()
        model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=1)
    finally:
        for h in handles:
            h.remove()

    layers = []
    for m in mods:
        c = captured[m.layer_idx]
        layer = cache.layers[m.layer_idx]
        q = _recompute_queries(m, c["hidden"], c["cos"], c["sin"])
        B, Hq, W, D = q.shape
        out = c["out"].reshape(B, W, Hq, D).transpose(1, 2)
        layers.append((layer.keys, layer.values, q, out))
    return layers


def check_queries(layers, scale_of) -> None:
    """Raise RuntimeError when recomputed queries do not reproduce the model's attention output."""
    for idx, (k, v, q, out) in enumerate(layers):
        B, H, T, _ = k.shape
        ref = proportional_attention(q, k, v, torch.zeros(B, H, T, device=k.device), causal=True,
                                     scale=scale_of(idx))
        err = float((ref.float() - out.float()).norm() / out.float().norm().clamp(min=1e-12))
        if err > QUERY_CHECK_TOL:
            raise RuntimeError(
                f"recomputed queries of layer {idx} give attention outputs {err:.2e} away from the model's "
                f"(tolerance {QUERY_CHECK_TOL}): this model family builds queries differently; "
                f"outlier calibration does not support it yet")


def calibrate_outlier_heads(
    model,
    tokenizer,
    text: str | None = None,
    config: PipelineConfig | str = "centroidkv",
    *,
    input_ids: Tensor | None = None,
    window: int = 32,
    fraction: float = DEFAULT_FRACTION,
    max_tokens: int = 4096,
    path: str | Path | None = None,
    **overrides,
) -> dict:
    """Score every (layer, KV head) by the attention-output error compression causes, and pick
    the worst ``fraction`` of heads (at least one when fraction > 0) to keep their full cache.

    text / input_ids: the calibration sequence (one of them; ids [1, T]); at most max_tokens used
    config:           the pipeline whose compression is measured (its full_heads are ignored)
    window:           W, the last tokens whose queries are measured (kept raw)
    path:             where to write the JSON report (optional)
    returns           {"full_heads": [[l, h], ...], "scores": [[...] per layer], "fraction", "window",
                       "tokens", "config", "model"}
    """
    check_int("window", window, 1)
    check_int("max_tokens", max_tokens, 2)
    require((text is None) != (input_ids is None), "text/input_ids", (type(text).__name__, type(input_ids).__name__),
            "exactly one of them")
    if input_ids is None:
        input_ids = tokenizer(text, return_tensors="pt").input_ids
    input_ids = input_ids[:, :max_tokens].to(next(model.parameters()).device)
    require(input_ids.shape[1] > window, "calibration tokens", input_ids.shape[1], f"more than window={window}")
    cfg = as_config(config, **overrides).replace(full_heads=())
    pipeline = Pipeline(cfg)
    vocab = None
    if tokenizer is not None:
        from .vocab import token_texts

        vocab = token_texts(tokenizer)

    layers = collect_layers(model, input_ids, window)
    mods = _attention_modules(model)
    check_queries(layers, lambda i: mods[i].scaling)
    scores = torch.stack([
        head_errors(pipeline, k, v, q, window, token_ids=input_ids, vocab=vocab, scale=mods[i].scaling)
        for i, (k, v, q, _) in enumerate(layers)
    ])  # [L, H_kv]
    report = outlier_report(scores, fraction, window=window, tokens=int(input_ids.shape[1]),
                            config=cfg.to_dict(), model=getattr(model.config, "_name_or_path", None) or
                            type(model).__name__)
    if path is not None:
        save_outlier_heads(path, report)
    return report
