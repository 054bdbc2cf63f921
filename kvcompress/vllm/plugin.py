"""The ``vllm.general_plugins`` entry point (``kvcompress = kvcompress.vllm.plugin:register``).

vLLM calls ``register()`` in every process it starts. It makes the compression's pieces known:
the KV-cache spec and its block-freeing manager (``kvcompress.vllm.backend``), and, when the
plugin is switched on (``KVCOMPRESS_VLLM_PRESET`` set, or ``KVCOMPRESS_VLLM=1``), the attention
backend: vLLM's CPU_ATTN (CPU) or FLEX_ATTENTION (CUDA) name then resolves to
``KVCompressFlexBackend``. With neither variable set, an installed kvcompress changes nothing in
vLLM. The compressing worker (``worker_cls="kvcompress.vllm.worker.CPUWorker"``) also switches
the backend on in its own process, so ``additional_config`` alone is enough there.
"""

from __future__ import annotations

import os

BACKEND = "kvcompress.vllm.backend.KVCompressFlexBackend"
_ORIGINAL: dict = {}


def enabled_by_env() -> bool:
    return bool(os.environ.get("KVCOMPRESS_VLLM_PRESET")) or os.environ.get("KVCOMPRESS_VLLM", "0") == "1"


def register_backend_override() -> None:
    """Map the platform's attention backend name to ours (idempotent)."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, _ATTN_OVERRIDES, register_backend

    name = AttentionBackendEnum.CPU_ATTN if current_platform.is_cpu() else AttentionBackendEnum.FLEX_ATTENTION
    if name not in _ORIGINAL:
        _ORIGINAL[name] = _ATTN_OVERRIDES.get(name)
    register_backend(name, BACKEND)
    _forget_resolved_backends()


def unregister_backend_override() -> None:
    """Undo ``register_backend_override`` (the name resolves as before again)."""
    from vllm.v1.attention.backends.registry import _ATTN_OVERRIDES

    for name, previous in _ORIGINAL.items():
        if previous is None:
            _ATTN_OVERRIDES.pop(name, None)
        else:
            _ATTN_OVERRIDES[name] = previous
    _ORIGINAL.clear()
    _forget_resolved_backends()


def _forget_resolved_backends() -> None:
    # vLLM memoizes the backend class each selection resolved to: an engine made earlier in
    # this process would otherwise pin the next one to the old mapping
    from vllm.v1.attention import selector

    cached = getattr(selector, "_cached_get_attn_backend", None)
    if cached is not None and hasattr(cached, "cache_clear"):
        cached.cache_clear()


def register() -> None:
    from . import backend  # noqa: F401  (registers CompressedAttentionSpec and its manager)

    if enabled_by_env():
        register_backend_override()
