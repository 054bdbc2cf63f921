"""The compiled FlexAttention kernel of proportional attention, and its SDPA twin.

``flex_proportional_attention`` calls one ``torch.compile``'d flex_attention (inductor; on CPU it
needs a C++ compiler). Shapes that change from step to step (slots N, query length L) are marked
dynamic, so a generation compiles a handful of graphs, not one per step (L == 1 and N == 1 are
specialised by dynamo and get their own graph); batch size, heads, head dims, dtype and device
stay static, one kernel (code object) each. ``compile_count()`` counts the graphs compiled here.
Causality and ``use_sizes`` are data (a 0-d offset tensor and the bias tensor), not Python flags,
so they never cause recompiles. The kernels are cached per process on purpose: torch.compile's
own graph cache is per process, and a kernel is a pure function of its signature.

CPU head dims: the compiled CPU flex kernel of torch 2.13 returned wrong numbers (even NaN) for
head dims 8 and 16 at some N, so on CPU flex requires D, D_v >= CPU_MIN_HEAD_DIM (32).
Dtypes: float16 / bfloat16 inputs run natively; the bias is float32 and flex adds it to float32
scores; the output has the query's dtype. A query row that sees no slot gives zeros.
"""

from __future__ import annotations

import types
from typing import Callable

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import flex_attention

from ..attention import proportional_attention
from ..validation import require
from .score_mods import NEG_INF, bottom_right_causal, compose, log_size_bias

CPU_MIN_HEAD_DIM = 32


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


