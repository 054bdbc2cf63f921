"""The proportional-attention backend of one cache: "sdpa", "flex" or "auto".

Each ``CompressedCache`` holds its own ``Backends``: with "auto" it owns a
``kvcompress.flex.BackendChooser`` (its probe decisions live and die with the cache), so two
caches in one process never share or overwrite each other's choice. "sdpa" never imports
``kvcompress.flex`` (which pulls in torch.compile, seconds on first import).
"""

from __future__ import annotations

from ..attention import proportional_attention
from ..validation import check_choice, require

BACKENDS = ("auto", "flex", "sdpa")


def _sdpa(query, keys, values, log_sizes, *, scale, causal, use_sizes):
    return proportional_attention(query, keys, values, log_sizes, causal=causal, scale=scale, use_sizes=use_sizes)


class Backends:
    """backend: "auto" (the cache's chooser: SDPA on CUDA, on CPU the faster one by a probe),
    "flex" or "sdpa". Called as the AttentionRequest's ``attend``."""

    def __init__(self, backend: str = "auto"):
        check_choice("backend", backend, BACKENDS)
        self.backend = backend
        self._chooser = None

    def __deepcopy__(self, memo):
        return self  # a copy of a cache keeps its backend and what the chooser learned

    @property
    def chooser(self):
        """The cache's ``kvcompress.flex.BackendChooser`` (created on first use)."""
        if self._chooser is None:
            try:
                from ..flex import BackendChooser  # noqa: PLC0415 - imported on first use only
            except ImportError as exc:  # a torch without FlexAttention
                raise ValueError(f"backend={self.backend!r} is invalid: expected kvcompress.flex (FlexAttention) "
                                 f"to be importable ({exc}); use backend='sdpa'") from exc
            self._chooser = BackendChooser()
        return self._chooser

    def __call__(self, query, keys, values, log_sizes, *, scale, causal, use_sizes, backend=None):
        """query [B, Hq, L, D], keys/values [B, Hkv, N, D], log_sizes [B, Hkv, N] -> [B, Hq, L, Dv].
        backend: a forced "flex" / "sdpa" (the attention implementation's name), else the cache's."""
        name = backend or self.backend
        if name == "sdpa":
            return _sdpa(query, keys, values, log_sizes, scale=scale, causal=causal, use_sizes=use_sizes)
        require(name in BACKENDS, "backend", name, f"one of {BACKENDS}")
        return self.chooser.attend(query, keys, values, log_sizes, scale=scale, causal=causal,
                                   use_sizes=use_sizes, backend=None if name == "auto" else name)


def compile_count() -> int:
    """Graphs compiled so far by the flex kernel (0 while kvcompress.flex was never imported)."""
    import sys

    flex = sys.modules.get("kvcompress.flex")
    return 0 if flex is None else int(flex.compile_count())
