"""Proportional attention through FlexAttention (pure torch), with an SDPA path and a chooser.

softmax(q K^T * scale + log s) V over a compressed cache: a slot that stands for s tokens gets
log s added to its logit; padding slots carry log s = -inf and are never attended.

Three layers, each usable on its own:

1. ``score_mod`` factories in the attention-gym style (closures with a stable ``__name__``):
   ``log_size_bias``, ``padding_mask``, ``bottom_right_causal``, ``compose`` and
   ``proportional_score_mod`` (all three in one). Pass them to
   ``torch.nn.attention.flex_attention.flex_attention(..., enable_gqa=True)``: the query head h
   reads the log-sizes of its KV head ``h // groups``, so keys are never repeated.
   ``bottom_right_causal_mask`` / ``causal_block_mask`` give the same causality as a mask_mod /
   BlockMask for callers who want block sparsity on long prefills.
2. ``flex_proportional_attention``: calls one ``torch.compile``'d flex_attention (inductor; on CPU
   it needs a C++ compiler). Shapes that change from step to step (slots N, query length L) are
   marked dynamic, so a generation compiles a handful of graphs, not one per step (L == 1 and
   N == 1 are specialised by dynamo and get their own graph); batch size, heads, head dims,
   dtype and device stay static, one kernel (code object) each. ``compile_count()`` counts the
   graphs compiled by this module. Causality and ``use_sizes`` are data (a 0-d offset tensor and
   the bias tensor), not Python flags, so they never cause recompiles; offsets are tensors
   because inductor-CPU failed on Python-int offsets after a dynamic recompile.
3. ``sdpa_proportional_attention`` (same signature, wraps ``kvcompress.attention``) and
   ``auto_proportional_attention``, which picks a backend per call: FlexAttention on CUDA, SDPA on
   other non-CPU devices, and on CPU whichever was faster on a small probe (the first call of
   each (device, dtype, shapes, L bucket, N bucket) times both on that call's inputs; the decision
   is cached). Override with ``set_backend("flex" | "sdpa" | None)``, the environment variable
   ``KVCOMPRESS_ATTENTION`` or the ``backend=`` argument.

CPU head dims: the compiled CPU flex kernel of torch 2.13 returned wrong numbers (even NaN) for
head dims 8 and 16 at some N (not for 24, 32, 48, 64, 128), so on CPU flex requires
D, D_v >= CPU_MIN_HEAD_DIM (32) and the chooser uses SDPA below that; every CPU probe also
compares the two outputs and keeps SDPA if they disagree.

Dtypes: float16 / bfloat16 inputs run natively on CPU and CUDA; log-sizes and the bias are
float32 and flex adds them to float32 scores; the output has the query's dtype.
A query row that can see no slot at all (only padding) gives zeros, on both backends (torch 2.13).
"""

from __future__ import annotations

import math
import os
import time
import types
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from .attention import proportional_attention
from .validation import check_choice, require

__all__ = [
    "ScoreMod", "log_size_bias", "padding_mask", "bottom_right_causal", "compose",
    "proportional_score_mod", "bottom_right_causal_mask", "causal_block_mask",
    "flex_proportional_attention", "sdpa_proportional_attention", "auto_proportional_attention",
    "choose_backend", "set_backend", "get_backend_override", "backend_decisions",
    "clear_backend_decisions", "compile_count", "reset_compile_count", "BACKENDS",
    "BackendDecision", "CPU_MIN_HEAD_DIM", "PROBE_REPEATS",
]

ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
BACKENDS = ("flex", "sdpa")
NEG_INF = float("-inf")
CPU_MIN_HEAD_DIM = 32


# ---------------------------------------------------------------------------- score_mod factories
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


# ---------------------------------------------------------------------------- compiled kernel
_COMPILES = [0]


def _counting_inductor(gm, example_inputs):
    """Inductor, counting every graph it is asked to compile (one per dynamo (re)compile)."""
    from torch._inductor.compile_fx import compile_fx

    _COMPILES[0] += 1
    return compile_fx(gm, example_inputs)


def compile_count() -> int:
    """Graphs compiled so far by this module's flex kernel (all shapes, dtypes, devices)."""
    return _COMPILES[0]


def reset_compile_count() -> None:
    """Zero the counter (compiled graphs stay cached)."""
    _COMPILES[0] = 0


def _flex_kernel(query, keys, values, bias, offset, groups: int, scale: float | None):
    # Causality and use_sizes arrive as tensors, so every mode shares a graph.
    score_mod = compose(log_size_bias(bias, groups), bottom_right_causal(offset))
    return flex_attention(query, keys, values, score_mod=score_mod, scale=scale, enable_gqa=True)


_KERNELS: dict[tuple, Callable] = {}


def _kernel_for(query: Tensor, keys: Tensor, values: Tensor) -> Callable:
    """The compiled kernel of one (device, dtype, B, H_q, H_kv, D, D_v).

    Dynamo caches graphs per code object and fails hard (fullgraph) after recompile_limit (8)
    graphs, which a long-lived process with several models or batch sizes would reach with one
    shared kernel; each signature therefore gets its own copy of the code object, holding at
    most the L == 1 / L > 1 and N == 1 / N > 1 variants.
    dynamic=False turns off automatic dynamic shapes: only N and L, marked in
    ``_mark_dynamic``, are symbolic. (A batch dim made dynamic by automatic dynamic made
    inductor's CPU flex template emit C++ that does not compile, "'cur_qSplitSize4' was not
    declared", in torch 2.13.)
    """
    sig = (str(query.device), query.dtype, query.shape[0], query.shape[1], keys.shape[1],
           query.shape[3], values.shape[3])
    fn = _KERNELS.get(sig)
    if fn is None:
        code = _flex_kernel.__code__.replace(co_name=f"_flex_kernel_{len(_KERNELS)}")
        fresh = types.FunctionType(code, _flex_kernel.__globals__, code.co_name)
        fn = _KERNELS[sig] = torch.compile(fresh, backend=_counting_inductor, fullgraph=True,
                                           dynamic=False)
    return fn


def _check_inputs(query: Tensor, keys: Tensor, values: Tensor, log_sizes: Tensor, causal: bool) -> None:
    require(query.dim() == 4, "query", tuple(query.shape), "a 4-d tensor [B, H_q, L, D]")
    require(keys.dim() == 4, "keys", tuple(keys.shape), "a 4-d tensor [B, H_kv, N, D]")
    B, Hq, L, D = query.shape
    Bk, Hkv, N, Dk = keys.shape
    require((Bk, Dk) == (B, D), "keys", tuple(keys.shape), f"batch {B} and head dim {D} like the query")
    require(Hkv > 0 and Hq % Hkv == 0, "query heads", Hq, f"a multiple of the {Hkv} key/value heads")
    require(values.dim() == 4 and tuple(values.shape[:3]) == (B, Hkv, N), "values",
            tuple(values.shape), f"shape {(B, Hkv, N)} + (D_v,)")
    require(tuple(log_sizes.shape) == (B, Hkv, N), "log_sizes", tuple(log_sizes.shape), f"shape {(B, Hkv, N)}")
    require(log_sizes.is_floating_point(), "log_sizes.dtype", log_sizes.dtype, "a floating dtype")
    require(query.is_floating_point(), "query.dtype", query.dtype, "a floating dtype")
    require(keys.dtype == query.dtype and values.dtype == query.dtype, "keys/values dtype",
            (keys.dtype, values.dtype), f"the query's dtype {query.dtype}")
    for name, t in (("keys", keys), ("values", values), ("log_sizes", log_sizes)):
        require(t.device == query.device, f"{name}.device", str(t.device), f"the query's device {query.device}")
    require(N >= 1 and L >= 1, "sequence lengths", (L, N), "L >= 1 query tokens and N >= 1 slots")
    require(not causal or L <= N, "query length", L,
            f"at most the {N} slots when causal (the new tokens must already be in the cache)")


def _check_flex_head_dims(query: Tensor, values: Tensor) -> None:
    dims = (query.shape[-1], values.shape[-1])
    require(query.device.type != "cpu" or min(dims) >= CPU_MIN_HEAD_DIM, "head dims (D, D_v)", dims,
            f">= {CPU_MIN_HEAD_DIM} for FlexAttention on CPU (inductor's CPU flex kernel gave wrong "
            "results for head dims 8 and 16 in torch 2.13); use sdpa_proportional_attention")


def _validate(backend: str, query: Tensor, keys: Tensor, values: Tensor, log_sizes: Tensor, causal: bool) -> None:
    """Every input check of ``backend``'s proportional attention (one place for all entry points)."""
    _check_inputs(query, keys, values, log_sizes, causal)
    if backend == "flex":
        _check_flex_head_dims(query, values)


def _mark_dynamic(query: Tensor, keys: Tensor, values: Tensor, bias: Tensor) -> None:
    # The kernels compile with dynamic=False, so these marks are the only symbolic dims: the
    # first graph already covers every later N (and every L > 1).
    if torch.compiler.is_compiling():
        return
    if query.shape[2] > 1:
        torch._dynamo.maybe_mark_dynamic(query, 2)
    if keys.shape[2] > 1:
        for t in (keys, values, bias):
            torch._dynamo.maybe_mark_dynamic(t, 2)


def flex_proportional_attention(
    query: Tensor,
    keys: Tensor,
    values: Tensor,
    log_sizes: Tensor,
    *,
    scale: float | None = None,
    causal: bool = True,
    use_sizes: bool = True,
) -> Tensor:
    """Proportional attention with a torch.compile'd FlexAttention (GQA without repeated keys).

    query:     [B, H_q, L, D]     the L new tokens, which are the last L of the N slots
    keys:      [B, H_kv, N, D]    H_q a multiple of H_kv; same dtype and device as the query
    values:    [B, H_kv, N, D_v]
    log_sizes: [B, H_kv, N]       log tokens-per-slot (-inf = padding, never attended)
    scale:     logit scale, default 1 / sqrt(D)
    causal:    query i sees slots < N - L + i + 1 (bottom-right in slot space)
    use_sizes: False drops the size bias but still masks padding
    returns    [B, H_q, L, D_v] in the query's dtype

    Works on CPU (inductor + a C++ compiler) and CUDA; see ``compile_count()``. Strides are
    static in the compiled graph: pass contiguous tensors (as a cache grown by torch.cat holds),
    or always slices of one fixed buffer; switching between the two adds a graph.
    On CPU, D and D_v must be >= CPU_MIN_HEAD_DIM.
    """
    _validate("flex", query, keys, values, log_sizes, causal)
    B, Hq, L, _ = query.shape
    Hkv, N = keys.shape[1], keys.shape[2]
    bias = log_sizes.float()  # [B, H_kv, N]
    if not use_sizes:
        bias = torch.where(bias == NEG_INF, NEG_INF, 0.0)
    # Non-causal = an offset no slot index can exceed.
    offset = torch.tensor(N - L if causal else N, dtype=torch.int64, device=query.device)
    _mark_dynamic(query, keys, values, bias)
    return _kernel_for(query, keys, values)(query, keys, values, bias, offset, Hq // Hkv,
                                            None if scale is None else float(scale))


def sdpa_proportional_attention(
    query: Tensor,
    keys: Tensor,
    values: Tensor,
    log_sizes: Tensor,
    *,
    scale: float | None = None,
    causal: bool = True,
    use_sizes: bool = True,
) -> Tensor:
    """Same contract as ``flex_proportional_attention``, on scaled_dot_product_attention.

    An additive float32 bias [B, H_kv, G * L, N]; the G query heads of a KV head are stacked as
    query rows, so keys are not repeated. Computed in float32, returned in the query's dtype.
    """
    _validate("sdpa", query, keys, values, log_sizes, causal)
    return proportional_attention(query, keys, values, log_sizes, causal=causal, scale=scale,
                                  use_sizes=use_sizes)


# ---------------------------------------------------------------------------- backend choice
@dataclass(frozen=True)
class BackendDecision:
    """Why a backend was chosen for one bucket; times are the best of the probe runs (ms)."""

    backend: str
    reason: str
    flex_ms: float | None = None
    sdpa_ms: float | None = None


_OVERRIDE: list[str | None] = [None]
_DECISIONS: dict[tuple, BackendDecision] = {}
_IMPLS = {"flex": flex_proportional_attention, "sdpa": sdpa_proportional_attention}
PROBE_REPEATS = 3
# flex vs SDPA disagreement above which a probe distrusts flex (the references agree to ~1e-6
# in float32; half dtypes differ by output rounding).
_PROBE_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-3}
_PROBE_TOLERANCE_HALF = 5e-2


def set_backend(backend: str | None) -> None:
    """Force "flex" or "sdpa" for every automatic call in this process; None restores the choice."""
    if backend is not None:
        check_choice("backend", backend, BACKENDS)
    _OVERRIDE[0] = backend


def get_backend_override() -> str | None:
    """set_backend's value, else KVCOMPRESS_ATTENTION ("flex" / "sdpa"; "auto" or unset = None)."""
    if _OVERRIDE[0] is not None:
        return _OVERRIDE[0]
    env = os.environ.get("KVCOMPRESS_ATTENTION", "").strip().lower()
    if env in ("", "auto"):
        return None
    check_choice("KVCOMPRESS_ATTENTION", env, BACKENDS + ("auto",))
    return env


def backend_decisions() -> dict[tuple, BackendDecision]:
    """Cached CPU probe results, keyed (device, dtype, B, H_q, H_kv, D, L bucket, N bucket)."""
    return dict(_DECISIONS)


def clear_backend_decisions() -> None:
    _DECISIONS.clear()


def _pow2_bucket(n: int, minimum: int) -> int:
    return max(minimum, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def _bucket_key(query: Tensor, keys: Tensor) -> tuple:
    B, Hq, L, D = query.shape
    return (str(query.device), query.dtype, B, Hq, keys.shape[1], D,
            1 if L == 1 else _pow2_bucket(L, 2), _pow2_bucket(keys.shape[2], 128))


def _rule(device_type: str, head_dims: tuple[int, int]) -> str | None:
    """The backend fixed by the device alone, or None where a probe decides (CPU)."""
    if device_type == "cuda":
        return "flex"
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


def choose_backend(
    query: Tensor, keys: Tensor, values: Tensor | None = None, log_sizes: Tensor | None = None,
    **kwargs,
) -> str:
    """The backend an automatic call uses for these inputs: "flex" or "sdpa".

    query: [B, H_q, L, D], keys: [B, H_kv, N, D], values: [B, H_kv, N, D_v], log_sizes: [B, H_kv, N]

    Order: the set_backend / KVCOMPRESS_ATTENTION override; "flex" on CUDA; "sdpa" on other
    non-CPU devices and for CPU head dims below CPU_MIN_HEAD_DIM; on CPU the cached decision of
    this bucket (N rounded up to a power of two >= 128, L to 1 or a power of two), else a probe
    when values and log_sizes are given. The probe runs both backends PROBE_REPEATS + 1 times on
    these inputs (the first call of a bucket thus costs a flex compile, seconds on CPU), keeps
    the faster, and keeps SDPA if flex fails or disagrees with it. Without values and log_sizes
    an unprobed CPU bucket answers "sdpa" and caches nothing. kwargs: scale / causal / use_sizes.
    """
    override = get_backend_override()
    if override is not None:
        return override
    fixed = _rule(query.device.type, (query.shape[-1], query.shape[-1] if values is None else values.shape[-1]))
    if fixed is not None:
        return fixed
    key = _bucket_key(query, keys)
    decision = _DECISIONS.get(key)
    if decision is None:
        if values is None or log_sizes is None:
            return "sdpa"
        _validate("sdpa", query, keys, values, log_sizes, kwargs.get("causal", True))
        decision = _DECISIONS[key] = _probe(query, keys, values, log_sizes, kwargs)
    return decision.backend


def auto_proportional_attention(
    query: Tensor,
    keys: Tensor,
    values: Tensor,
    log_sizes: Tensor,
    *,
    scale: float | None = None,
    causal: bool = True,
    use_sizes: bool = True,
    backend: str | None = None,
) -> Tensor:
    """Proportional attention on ``backend``: "flex", "sdpa", or None / "auto" (choose_backend).

    Shapes and semantics as in ``flex_proportional_attention``: query [B, H_q, L, D], keys
    [B, H_kv, N, D], values [B, H_kv, N, D_v], log_sizes [B, H_kv, N] -> [B, H_q, L, D_v].
    """
    if backend is not None:
        check_choice("backend", backend, BACKENDS + ("auto",))
    kwargs = dict(scale=scale, causal=causal, use_sizes=use_sizes)
    if backend in (None, "auto"):
        backend = choose_backend(query, keys, values, log_sizes, **kwargs)
    return _IMPLS[backend](query, keys, values, log_sizes, **kwargs)
