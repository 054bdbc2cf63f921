"""transformers integration: a compressed Cache and proportional attention implementations.

The only package of kvcompress that imports transformers. Nothing is patched at import time:

    from kvcompress.hf import CompressedCache
    cache = CompressedCache.for_model(model, tokenizer, "semanticache", keep_ratio=0.5)
    out = model.generate(**inputs, cache=cache, max_new_tokens=64)  # past_key_values= before the rename
    cache.close()  # or `with CompressedCache.for_model(...) as cache:`; restores the attention implementation

``register_attention()`` registers "kvcompress", "kvcompress_flex" and "kvcompress_bias" with
transformers (``for_model`` does it for you).
"""

from .attention import AttentionRequest, attention_received, register_attention
from .backends import Backends, compile_count
from .cache import CacheSnapshot, CompressedCache
from .layer import CompressedLayer
from .schedule import Scheduler
from .support import ATTN_AUTO, ATTN_BIAS, ATTN_FLEX, ATTN_NAMES, ModelGeometry, check_supported, sliding_windows
from .vocab import token_texts

__all__ = [
    "CompressedCache", "CompressedLayer", "CacheSnapshot", "Scheduler", "AttentionRequest", "Backends",
    "register_attention", "compile_count", "attention_received", "token_texts", "check_supported",
    "sliding_windows", "ModelGeometry", "ATTN_AUTO", "ATTN_FLEX", "ATTN_BIAS", "ATTN_NAMES",
]
