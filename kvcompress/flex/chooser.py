"""Which proportional-attention backend a call uses: ``BackendChooser``.

A chooser picks per call: SDPA on CUDA and other non-CPU devices, and on CPU whichever was
faster on a small probe (the first call of each (device, dtype, shapes, L bucket,
N bucket) times both on that call's inputs; the decision is kept by the chooser). Each
``CompressedCache`` holds its own chooser; the module-level functions (``choose_backend``,
``auto_proportional_attention``, ``set_backend``) use one default chooser for direct callers.
Override with ``BackendChooser(override=...)``, ``set_backend`` (the default chooser), the
environment variable ``KVCOMPRESS_ATTENTION`` or an explicit ``backend=``.
"""

from __future__ import annotations

import math
import os
import time
import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

from ..validation import check_choice
from .kernels import CPU_MIN_HEAD_DIM, _validate, flex_proportional_attention, sdpa_proportional_attention

BACKENDS = ("flex", "sdpa")
_IMPLS = {"flex": flex_proportional_attention, "sdpa": sdpa_proportional_attention}
PROBE_REPEATS = 3
# flex vs SDPA disagreement above which a probe distrusts flex (the references agree to ~1e-6
# in float32; half dtypes differ by output rounding).
_PROBE_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-3}
_PROBE_TOLERANCE_HALF = 5e-2


@dataclass(frozen=True)
class BackendDecision:
    """Why a backend was chosen for one bucket; times are the best of the probe runs (ms)."""

    backend: str
    reason: str
    flex_ms: float | None = None
    sdpa_ms: float | None = None


def environment_override() -> str | None:
    """KVCOMPRESS_ATTENTION ("flex" / "sdpa"; "auto" or unset = None)."""
    env = os.environ.get("KVCOMPRESS_ATTENTION", "").strip().lower()
    if env in ("", "auto"):
        return None
    check_choice("KVCOMPRESS_ATTENTION", env, BACKENDS + ("auto",))
    return env


def _pow2_bucket(n: int, minimum: int) -> int:
    return max(minimum, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def _bucket_key(query: Tensor, keys: Tensor) -> tuple:
    B, Hq, L, D = query.shape
    return (str(query.device), query.dtype, B, Hq, keys.shape[1], D,
            1 if L == 1 else _pow2_bucket(L, 2), _pow2_bucket(keys.shape[2], 128))


def _rule(device_type: str, head_dims: tuple[int, int]) -> str | None:
    """The backend fixed by the device alone, or None where a probe decides (CPU).

    CUDA: SDPA in the cache's dtype (``kvcompress.attention.native_dtype``). The compiled flex
    kernel took 1.5-2.0 ms per decode query over 32k slots against SDPA's 0.04 ms (H200, torch
    2.11, benchmarks/results/gpu_decode_probe.json): it does not split the keys across the GPU.
    """
    if device_type != "cpu" or min(head_dims) < CPU_MIN_HEAD_DIM:
        return "sdpa"
    return None


def _best_ms(fn, repeats: int) -> tuple[float, Tensor]:
    out = fn()  # warm-up (compiles flex on first use)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3, out


def _probe(query, keys, values, log_sizes, kwargs) -> BackendDecision:
    sdpa_ms, ref = _best_ms(
        lambda: sdpa_proportional_attention(query, keys, values, log_sizes, **kwargs), PROBE_REPEATS)
    try:
        flex_ms, out = _best_ms(
            lambda: flex_proportional_attention(query, keys, values, log_sizes, **kwargs), PROBE_REPEATS)
    except Exception as exc:  # no C++ compiler, inductor bug: SDPA still gives the right answer
        warnings.warn(f"FlexAttention failed on {query.device} ({type(exc).__name__}: {exc}); "
                      "using SDPA", RuntimeWarning, stacklevel=4)
        return BackendDecision("sdpa", "flex failed", None, sdpa_ms)
    seen = ~torch.isnan(ref)  # rows that see no slot: NaN on SDPA, zeros on flex
    err = float((out.float() - ref.float()).abs().masked_fill(~seen, 0).max()) if out.numel() else 0.0
    if not err <= _PROBE_TOLERANCE.get(query.dtype, _PROBE_TOLERANCE_HALF):
        warnings.warn(f"FlexAttention disagrees with SDPA by {err:.3g} on {query.device} "
                      f"{tuple(query.shape)} {query.dtype}; using SDPA", RuntimeWarning, stacklevel=4)
        return BackendDecision("sdpa", "flex disagreed", flex_ms, sdpa_ms)
    return BackendDecision("flex" if flex_ms < sdpa_ms else "sdpa", "probe", flex_ms, sdpa_ms)


class BackendChooser:
    """Backend decisions of one owner (a cache, or the module's default for direct calls).

    override: "flex" or "sdpa" for every automatic call of this chooser; None = choose
    probe:    the CPU probe, fn(query, keys, values, log_sizes, kwargs) -> BackendDecision
    """

    def __init__(self, override: str | None = None, probe=None):
        self.override = override
        self._probe = probe
        self._decisions: dict[tuple, BackendDecision] = {}

    @property
    def override(self) -> str | None:
        return self._override

    @override.setter
    def override(self, backend: str | None) -> None:
        if backend is not None:
            check_choice("backend", backend, BACKENDS)
        self._override = backend

    def decisions(self) -> dict[tuple, BackendDecision]:
        """Cached CPU probe results, keyed (device, dtype, B, H_q, H_kv, D, L bucket, N bucket)."""
        return dict(self._decisions)

    def clear(self) -> None:
        self._decisions.clear()

    def choose(self, query: Tensor, keys: Tensor, values: Tensor | None = None, log_sizes: Tensor | None = None,
               **kwargs) -> str:
        """The backend an automatic call uses for these inputs: "flex" or "sdpa".

        query: [B, H_q, L, D], keys: [B, H_kv, N, D], values: [B, H_kv, N, D_v], log_sizes: [B, H_kv, N]

        Order: this chooser's override, then KVCOMPRESS_ATTENTION; "sdpa" on CUDA and other
        non-CPU devices and for CPU head dims below CPU_MIN_HEAD_DIM; on CPU the cached decision
        of this bucket (N rounded up to a power of two >= 128, L to 1 or a power of two), else a
        probe when values and log_sizes are given. The probe runs both backends PROBE_REPEATS + 1
        times on these inputs (the first call of a bucket thus costs a flex compile, seconds on
        CPU), keeps the faster, and keeps SDPA if flex fails or disagrees with it. Without values
        and log_sizes an unprobed CPU bucket answers "sdpa" and caches nothing.
        kwargs: scale / causal / use_sizes.
        """
        override = self._override or environment_override()
        if override is not None:
            return override
        fixed = _rule(query.device.type,
                      (query.shape[-1], query.shape[-1] if values is None else values.shape[-1]))
        if fixed is not None:
            return fixed
        key = _bucket_key(query, keys)
        decision = self._decisions.get(key)
        if decision is None:
            if values is None or log_sizes is None:
                return "sdpa"
            _validate("sdpa", query, keys, values, log_sizes, kwargs.get("causal", True))
            probe = self._probe or _probe
            decision = self._decisions[key] = probe(query, keys, values, log_sizes, kwargs)
        return decision.backend

    def attend(self, query: Tensor, keys: Tensor, values: Tensor, log_sizes: Tensor, *, scale: float | None = None,
               causal: bool = True, use_sizes: bool = True, backend: str | None = None) -> Tensor:
        """Proportional attention on ``backend`` ("flex", "sdpa", or None / "auto": ``choose``).
        Shapes as in ``flex_proportional_attention``."""
        if backend is not None:
            check_choice("backend", backend, BACKENDS + ("auto",))
        kwargs = dict(scale=scale, causal=causal, use_sizes=use_sizes)
        if backend in (None, "auto"):
            backend = self.choose(query, keys, values, log_sizes, **kwargs)
        return _IMPLS[backend](query, keys, values, log_sizes, **kwargs)


DEFAULT = BackendChooser()  # the chooser of direct calls to the functions below (not of caches)


def set_backend(backend: str | None) -> None:
    """Force "flex" or "sdpa" for every automatic direct call; None restores the choice.
    (A cache's own chooser is set with its ``backend=`` argument.)"""
    DEFAULT.override = backend


def get_backend_override() -> str | None:
    """set_backend's value, else KVCOMPRESS_ATTENTION ("flex" / "sdpa"; "auto" or unset = None)."""
    return DEFAULT.override or environment_override()


def backend_decisions() -> dict[tuple, BackendDecision]:
    """The default chooser's cached CPU probe results."""
    return DEFAULT.decisions()


def clear_backend_decisions() -> None:
    DEFAULT.clear()


def choose_backend(query: Tensor, keys: Tensor, values: Tensor | None = None, log_sizes: Tensor | None = None,
                   **kwargs) -> str:
    """``DEFAULT.choose``: see ``BackendChooser.choose``."""
    return DEFAULT.choose(query, keys, values, log_sizes, **kwargs)


def auto_proportional_attention(query: Tensor, keys: Tensor, values: Tensor, log_sizes: Tensor, *,
                                scale: float | None = None, causal: bool = True, use_sizes: bool = True,
                                backend: str | None = None) -> Tensor:
    """Proportional attention on ``backend``: "flex", "sdpa", or None / "auto" (the default
    chooser). query [B, H_q, L, D], keys [B, H_kv, N, D], values [B, H_kv, N, D_v],
    log_sizes [B, H_kv, N] -> [B, H_q, L, D_v]."""
    return DEFAULT.attend(query, keys, values, log_sizes, scale=scale, causal=causal, use_sizes=use_sizes,
                          backend=backend)
