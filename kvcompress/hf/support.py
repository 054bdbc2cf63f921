"""Which transformers models the compressed cache supports, and their KV geometry."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..validation import require

# Attention implementation names registered by kvcompress.hf.attention. They must not contain
# "sdpa" or "flex_attention": transformers special-cases those substrings when dispatching.
ATTN_AUTO = "kvcompress"
ATTN_FLEX = "kvcompress_flex"
ATTN_BIAS = "kvcompress_bias"  # SDPA with an additive log-size bias
ATTN_NAMES = (ATTN_AUTO, ATTN_FLEX, ATTN_BIAS)


@dataclass(frozen=True)
class ModelGeometry:
    """What a cache built for one model expects from every layer's key/value states [B, H, N, D]."""

    num_layers: int
    num_kv_heads: int
    num_q_heads: int
    head_dim: int
    model_type: str = "?"

    @classmethod
    def of(cls, model) -> "ModelGeometry":
        cfg = text_config(model)
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        return cls(int(cfg.num_hidden_layers), int(kv_heads), int(heads), int(head_dim),
                   str(getattr(cfg, "model_type", "?")))

    def describe(self) -> str:
        return (f"{self.model_type}: {self.num_layers} layers, {self.num_kv_heads} KV heads, "
                f"{self.num_q_heads} query heads, head_dim {self.head_dim}")


def text_config(model):
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def sliding_windows(model) -> list[int | None]:
    """Per decoder layer: None for full attention (the cache compresses it), else the window of
    a sliding-window layer (kept as transformers' own layer: already bounded). A ValueError
    names any other layer type (chunked, linear, shared, ...)."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    cfg = text_config(model)
    name = getattr(cfg, "model_type", type(model).__name__)
    types, kwargs = get_layer_types_and_kwargs(cfg)
    out = []
    for i, (kind, kw) in enumerate(zip(types, kwargs)):
        if kind == "full_attention":
            out.append(None)
        elif kind == "sliding_attention" and kw.get("sliding_window"):
            out.append(int(kw["sliding_window"]))
        else:
            require(False, "model", name,
                    f"full-attention or sliding-window layers (layer {i} is {kind!r}: chunked, linear, shared "
                    "and other layer types are not supported by CompressedCache)")
    require(len(out) == int(cfg.num_hidden_layers), "model", name,
            f"one layer type per decoder layer ({len(out)} types for {cfg.num_hidden_layers} layers)")
    return out


def check_supported(model) -> None:
    """Raise ValueError, naming the reason, for models whose attention the cache cannot serve.

    Supported: decoder-only transformers models (Llama, Mistral, Qwen2/3, Phi-3, Gemma 1/2/3,
    GPT-NeoX, ... in transformers 5.x) whose layers are full attention (compressed) or sliding
    window (kept as transformers' own layers), without attention-logit softcapping.
    """
    require(isinstance(model, torch.nn.Module) and hasattr(model, "config"), "model", type(model).__name__,
            "a transformers PreTrainedModel")
    cfg = text_config(model)
    name = getattr(cfg, "model_type", type(model).__name__)
    require(not getattr(model.config, "is_encoder_decoder", False), "model", name,
            "a decoder-only model (encoder-decoder models are not supported)")
    for attr in ("num_hidden_layers", "num_attention_heads", "hidden_size"):
        require(hasattr(cfg, attr), "model", name, f"a config with {attr}")
    require(hasattr(model, "base_model"), "model", name, "a transformers PreTrainedModel with a base_model")
    softcap = getattr(cfg, "attn_logit_softcapping", None)
    require(softcap is None, "model", f"{name} with attn_logit_softcapping={softcap}",
            "a model without attention-logit softcapping (proportional attention adds its biases to "
            "uncapped logits; load the model with attn_logit_softcapping=None to drop it)")
    windows = sliding_windows(model)
    require(any(w is None for w in windows), "model", name,
            f"at least one full-attention layer to compress (every layer has a sliding window of {windows[0]} "
            "tokens, which bounds the cache already; set sliding_window=None in the config to compress "
            "full attention instead)")
