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


def check_supported(model) -> None:
    """Raise ValueError for models whose attention the compressed cache cannot serve.

    Supported: decoder-only models with full attention in every layer whose attention modules
    pass their kwargs to ``cache.update`` (Llama, Mistral without sliding window, Qwen2/3,
    Phi-3, Gemma 1, ... in transformers 5.x).
    """
    require(isinstance(model, torch.nn.Module) and hasattr(model, "config"), "model", type(model).__name__,
            "a transformers PreTrainedModel")
    cfg = text_config(model)
    name = getattr(cfg, "model_type", type(model).__name__)
    require(not getattr(model.config, "is_encoder_decoder", False), "model", name,
            "a decoder-only model (encoder-decoder models are not supported)")
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None:
        other = sorted({t for t in layer_types if t != "full_attention"})
        require(not other, "model", name,
                f"full attention in every layer (this model has {other} layers; sliding-window, chunked "
                "and linear-attention layers are not supported)")
    sliding = getattr(cfg, "sliding_window", None)
    if sliding is not None and getattr(cfg, "use_sliding_window", True) and layer_types is None:
        require(False, "model", name,
                f"full attention in every layer (sliding_window={sliding} is not supported)")
    for attr in ("num_hidden_layers", "num_attention_heads", "hidden_size"):
        require(hasattr(cfg, attr), "model", name, f"a config with {attr}")
    require(hasattr(model, "base_model"), "model", name, "a transformers PreTrainedModel with a base_model")
