"""Scorers: per-slot importance [B, H, N] (higher = keep), for eviction-based baselines.

Attention statistics come from the cache (see PipelineConfig):

- ``query_window = W``: the cache keeps the last W queries of each layer (after RoPE) in
  ``state.extras["queries"]`` with shape [B, H_q, W, D]. Scores are computed from them against
  the cache's *current* (possibly already merged) slots, with proportional attention (log-size
  bias), so a merged slot scores like the group of tokens it stands for. Only a [W, N] block of
  logits per head exists at a time, never the prompt's [N, N] attention matrix.
- ``track_attention = True``: the cache accumulates the attention each slot receives while
  decoding in ``state.stats["attn_acc"]`` [B, H_kv, N] (float32, summed over members on merges,
  0 for new slots).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..registry import register_scorer
from ..types import KVState
from ..validation import check_choice, check_int, require

QUERIES = "queries"  # state.extras key: [B, H_q, W, D] last queries of the layer
ATTN_ACC = "attn_acc"  # state.stats key: [B, H_kv, N] attention accumulated while decoding

REDUCTIONS = ("sum", "mean")

# logits materialised at once by window_attention (elements); larger layers loop over KV heads
_BLOCK_ELEMENTS = 1 << 25


def captured_queries(state: KVState, window: int | None, who: str) -> Tensor:
    """The last ``window`` captured queries, [B, H_q, W, D]; a ValueError naming query_window if absent."""
    q = state.extras.get(QUERIES)
    require(q is not None, f"{who}: state.extras[{QUERIES!r}]", None,
            "the last queries of the layer: set query_window > 0 in the PipelineConfig so the cache "
            "captures them")
    B, H, _, D = state.keys.shape
    require(isinstance(q, Tensor) and q.dim() == 4 and q.shape[0] == B and q.shape[3] == D
            and q.shape[1] % H == 0, f"{who}: state.extras[{QUERIES!r}]",
            tuple(q.shape) if isinstance(q, Tensor) else type(q).__name__,
            f"a tensor [B={B}, H_q (a multiple of {H}), W, D={D}]")
    if window is not None:
        require(window <= q.shape[2], f"{who}: window", window,
                f"at most the {q.shape[2]} queries the cache captured (raise query_window)")
        q = q[:, :, q.shape[2] - window:]
    require(q.shape[2] >= 1, "query_window", q.shape[2], "at least 1 captured query")
    return q


def query_positions(state: KVState, num_queries: int) -> Tensor:
    """[W] long: token positions of the captured queries (the last W tokens seen)."""
    return torch.arange(state.num_tokens - num_queries, state.num_tokens, device=state.keys.device)


def late_start(positions: Tensor, first_query: Tensor | int) -> int:
    """The first slot index at which any head of any row holds a slot later than the window's
    first query (``positions`` [B, H, N]); N when none does. Only columns from there on can be
    hidden from some query, so a causal mask needs to cover them alone (at the end of a prefill,
    the window's own last W slots)."""
    late = (positions > first_query).flatten(0, 1).any(0).nonzero()
    return int(late[0, 0]) if late.numel() else positions.shape[-1]


def window_attention(
    state: KVState,
    queries: Tensor,
    scale: float | None = None,
    proportional: bool = True,
    reduce: str = "sum",
) -> Tensor:
    """Attention each slot receives from the captured queries, summed over queries and over the
    query heads of each KV group (reduce="sum"), or averaged over the queries that can see the
    slot (reduce="mean": no bias against the slots inside the window, which fewer queries see).

    state:   keys [B, H, N, D], log_sizes [B, H, N], positions [B, H, N]
    queries: [B, H_q, W, D], the queries of the last W tokens (positions T - W .. T - 1)
    returns  [B, H, N] float32. Each query's softmax runs over the slots it may see (slot
             position <= query position, padding excluded) with log(size) added to the logits
             when ``proportional``; queries on left padding count for nothing.
    """
    check_choice("reduce", reduce, REDUCTIONS)
    keys = state.keys
    B, H, N, D = keys.shape
    Hq, W = queries.shape[1], queries.shape[2]
    G = Hq // H
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    qpos = query_positions(state, W)  # [W]
    valid = state.valid
    bias = state.log_sizes if proportional else torch.zeros_like(state.log_sizes)
    bias = bias.masked_fill(~valid, float("-inf"))  # [B, H, N]
    # the [W, N] causal mask over the columns some query may not see only
    tail = slice(late_start(state.positions, qpos[0]), N)
    visible = state.positions[:, :, None, tail] <= qpos[None, None, :, None]  # [B, H, W, N_tail]
    q_real = (qpos[None, :] >= state.start()[:, None]).float()  # [B, W]
    q = queries.reshape(B, H, G, W, D).float()

    out = torch.zeros(B, H, N, dtype=torch.float32, device=keys.device)
    step = max(1, _BLOCK_ELEMENTS // max(1, B * G * W * N))
    for h0 in range(0, H, step):
        hs = slice(h0, min(H, h0 + step))
        # in place: the same values as (qk * scale + bias, masked) without three more [G, W, N] buffers
        logits = torch.einsum("bhgwd,bhnd->bhgwn", q[:, hs], keys[:, hs].float()).mul_(scale)
        logits.add_(bias[:, hs, None, None, :])
        logits[..., tail].masked_fill_(~visible[:, hs, None], float("-inf"))
        probs = torch.softmax(logits, dim=-1).nan_to_num_(0.0)  # a query seeing nothing gives 0
        probs.mul_(q_real[:, None, None, :, None])
        out[:, hs] = probs.sum(dim=(2, 3))
    if reduce == "mean":
        # [B, H, N] queries seeing a slot: every real query for the slots before the tail
        seen = (q_real > 0).sum(-1)[:, None, None].expand(B, H, N).clone()
        seen[..., tail] = (visible & (q_real[:, None, :, None] > 0)).sum(2)
        out = out / (seen * G).clamp(min=1)
    return out


def _check_scale(scale) -> None:
    if scale is not None:
        require(isinstance(scale, (int, float)) and not isinstance(scale, bool) and scale > 0,
                "scale", scale, "None (1/sqrt(head_dim)) or a number > 0")


@register_scorer("knorm")
@dataclass(frozen=True)
class KeyNormScorer:
    """Key-norm (Devoto et al., 2024): keys with a LOW L2 norm draw attention; score = -||k||."""

    def __call__(self, state: KVState) -> Tensor:
        return -state.keys.float().norm(dim=-1)


@register_scorer("recency")
@dataclass(frozen=True)
class RecencyScorer:
    """Most recent first: score = position of the slot's representative token (StreamingLLM
    when combined with attention sinks)."""

    def __call__(self, state: KVState) -> Tensor:
        return state.positions.float()


@register_scorer("random")
@dataclass(frozen=True)
class RandomScorer:
    """Uniform random scores (a floor for comparisons). Reproducible: the generator is seeded
    with ``seed`` plus the tokens seen, so each recompression draws afresh."""

    seed: int = 0

    def __post_init__(self):
        check_int("seed", self.seed, 0)

    def __call__(self, state: KVState) -> Tensor:
        gen = torch.Generator().manual_seed(self.seed + state.num_tokens)
        return torch.rand(state.log_sizes.shape, generator=gen).to(state.keys.device)


@register_scorer("attention")
@dataclass(frozen=True)
class WindowAttentionScorer:
    """Attention received from the captured query window (the last W queries), over the window
    and the query heads of each KV group; no pooling. Unlike attention accumulated over a whole
    prompt it is not biased towards early tokens (CaM's relative attention uses it, averaged).

    window:       queries used (None = all the cache captured, i.e. PipelineConfig.query_window)
    reduce:       "sum" over queries and group heads, or "mean" over the queries that can see the
                  slot (slots inside the window are seen by fewer queries; CaM uses "mean")
    proportional: add log(size) to the logits
    scale:        logit scale (None = 1/sqrt(head_dim))
    """

    window: int | None = None
    reduce: str = "sum"
    proportional: bool = True
    scale: float | None = None

    def __post_init__(self):
        if self.window is not None:
            check_int("window", self.window, 1)
        check_choice("reduce", self.reduce, REDUCTIONS)
        require(isinstance(self.proportional, bool), "proportional", self.proportional, "True or False")
        _check_scale(self.scale)

    def __call__(self, state: KVState) -> Tensor:
        q = captured_queries(state, self.window, "attention")
        return window_attention(state, q, self.scale, self.proportional, self.reduce)


@register_scorer("snapkv")
@dataclass(frozen=True)
class SnapKVScorer:
    """SnapKV (Li et al., 2024): attention from the observation window (the last prompt queries),
    summed over the window and over the query heads of each KV group, then pooled along the
    slots with a 1-d max/avg pool so neighbours of important tokens survive with them.

    window:       queries used (None = all the cache captured, i.e. PipelineConfig.query_window)
    kernel_size:  pooling width (odd; 1 = no pooling)
    pooling:      "max" or "avg" (zero-padded at the edges, as SnapKV)
    proportional: add log(size) to the logits (False: plain attention, the paper's)
    scale:        logit scale (None = 1/sqrt(head_dim))

    Slots of the window itself are excluded from pooling (as in SnapKV) and score +inf: SnapKV
    always keeps its window (protect it with PipelineConfig.recent = window to make it explicit).
    """

    window: int | None = None
    kernel_size: int = 7
    pooling: str = "max"
    proportional: bool = True
    scale: float | None = None

    def __post_init__(self):
        if self.window is not None:
            check_int("window", self.window, 1)
        check_int("kernel_size", self.kernel_size, 1)
        require(self.kernel_size % 2 == 1, "kernel_size", self.kernel_size, "an odd integer (same-length pooling)")
        check_choice("pooling", self.pooling, ("max", "avg"))
        require(isinstance(self.proportional, bool), "proportional", self.proportional, "True or False")
        _check_scale(self.scale)

    def __call__(self, state: KVState) -> Tensor:
        q = captured_queries(state, self.window, "snapkv")
        attn = window_attention(state, q, self.scale, self.proportional)  # [B, H, N]
        in_window = state.valid & (state.positions >= state.num_tokens - q.shape[2])
        attn = attn.masked_fill(in_window | ~state.valid, 0.0)
        pooled = pool_slots(attn, self.kernel_size, self.pooling)
        return pooled.masked_fill(in_window, float("inf"))


def pool_slots(x: Tensor, kernel_size: int, pooling: str) -> Tensor:
    """1-d pooling along the slot axis, stride 1, zero padding k // 2: [B, H, N] -> [B, H, N]."""
    if kernel_size == 1:
        return x
    B, H, N = x.shape
    flat = x.reshape(B * H, 1, N)
    pad = kernel_size // 2
    if pooling == "max":
        out = F.max_pool1d(F.pad(flat, (pad, pad), value=0.0), kernel_size, stride=1)
    else:
        out = F.avg_pool1d(flat, kernel_size, stride=1, padding=pad, count_include_pad=True)
    return out.reshape(B, H, N)


@register_scorer("h2o")
@dataclass(frozen=True)
class H2OScorer:
    """H2O (Zhang et al., 2023): heavy hitters = slots with the most accumulated attention.

    Decoding: the attention accumulated by the cache (``track_attention``), per (row, head).
    Prefill (no attention accumulated yet in that row and head): the attention received from the
    captured query window (``query_window``), a bounded stand-in for H2O's sum over all prompt
    queries (equal to it when the window covers the prompt).

    window:       captured queries used at prefill (None = all)
    proportional: add log(size) to the logits of the window attention
    scale:        logit scale (None = 1/sqrt(head_dim))
    """

    window: int | None = None
    proportional: bool = True
    scale: float | None = None

    def __post_init__(self):
        if self.window is not None:
            check_int("window", self.window, 1)
        require(isinstance(self.proportional, bool), "proportional", self.proportional, "True or False")
        _check_scale(self.scale)

    def __call__(self, state: KVState) -> Tensor:
        acc = state.stats.get(ATTN_ACC)
        has_q = state.extras.get(QUERIES) is not None
        require(acc is not None or has_q, "h2o: state.stats/extras", sorted(state.stats) + sorted(state.extras),
                f"accumulated attention ({ATTN_ACC!r}: set track_attention=True) and/or the last "
                f"queries ({QUERIES!r}: set query_window > 0) in the PipelineConfig")
        B, H, N = state.log_sizes.shape
        if acc is not None:
            require(isinstance(acc, Tensor) and tuple(acc.shape) == (B, H, N),
                    f"h2o: state.stats[{ATTN_ACC!r}]", tuple(getattr(acc, "shape", ())), f"shape {(B, H, N)}")
            acc = acc.float().masked_fill(~state.valid, 0.0)
            accumulated = acc.sum(-1) > 0  # [B, H]
        else:
            accumulated = torch.zeros(B, H, dtype=torch.bool, device=state.keys.device)
        if bool(accumulated.all()):
            return acc
        require(has_q, f"h2o: state.extras[{QUERIES!r}]", None,
                "the last queries of the layer to score the prompt before any decoding attention is "
                "accumulated: set query_window > 0 in the PipelineConfig")
        win = window_attention(state, captured_queries(state, self.window, "h2o"), self.scale, self.proportional)
        return win if acc is None else torch.where(accumulated[..., None], acc, win)
