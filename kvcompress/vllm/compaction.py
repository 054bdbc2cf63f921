"""Compress one request's prompt inside vLLM's paged cache (plain torch + the core; no vLLM).

The prompt's P tokens sit at logical positions [0, P) of the request's blocks. After the
pipeline ran on every layer, layer l's n_l slots are written to the END of that range,
positions [P - n_l, P), with their log-sizes as the attention bias; the positions in front of
them that are still in a live block get bias -inf; whole blocks in front hold nothing and can be
returned to the pool. Positions stay as they were: the next token is P, so RoPE continues at the
request's true length and vLLM's slot mapping (position -> slot) needs no change.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..pipeline import Pipeline
from ..strategies import scratch
from ..types import NEG_INF, KVState
from ..validation import require


@dataclass(frozen=True)
class PagedLayer:
    """One layer's cache as flat slot tables: keys/values [num_slots, H, D] (views of vLLM's
    cache) and the bias columns [num_slots, H] of this layer."""

    keys: Tensor
    values: Tensor
    bias: Tensor


def prompt_slots(block_ids, prompt_tokens: int, block_size: int, device=None) -> Tensor:
    """[P] long: the physical slot of each prompt position (position -> block -> slot)."""
    pos = torch.arange(prompt_tokens, device=device)
    blocks = torch.as_tensor(list(block_ids), dtype=torch.long, device=device)
    require(blocks.numel() * block_size >= prompt_tokens, "block_ids", len(block_ids),
            f"at least {-(-prompt_tokens // block_size)} blocks for {prompt_tokens} tokens")
    return blocks[pos // block_size] * block_size + pos % block_size


@dataclass(frozen=True)
class CompactionResult:
    slots_per_layer: list[int]  # n_l: slot count written per layer (padding slots of short heads included)
    valid_slots: list[float]  # mean slots holding tokens per head, per layer
    start: int  # first position holding a slot in any layer (min_l P - n_l)
    dead_blocks: int  # leading blocks holding no slot
    trimmed_layers: int = 0  # layers the pipeline left above max_slots, cut by keep_within


def keep_within(state: KVState, limit: int, sinks: int) -> tuple[Tensor, Tensor, Tensor]:
    """keys, values [B, H, limit, D] and log_sizes [B, H, limit] of the ``limit`` slots per head
    that a compressed state keeps when it is still above ``limit`` (a budget the pipeline could
    not reach, e.g. more protected slots than the budget, while the scheduler has already freed
    the blocks for the rest): the ``sinks`` earliest slots, then the most recent ones, in position
    order (padding last)."""
    valid = state.valid  # [B, H, N]
    pos = state.positions.to(torch.float64)
    inf = float("inf")
    rank = torch.where(valid, pos, inf).argsort(-1).argsort(-1)  # 0 = the earliest valid slot
    # sinks rank above every position (the earliest first), then the latest positions
    top = float(state.num_tokens + sinks)
    key = torch.where(rank < sinks, top - rank.to(torch.float64), pos).masked_fill(~valid, -inf)
    idx = key.topk(limit, dim=-1).indices  # [B, H, limit]
    order = torch.where(valid.gather(-1, idx), pos.gather(-1, idx), inf).argsort(-1)
    idx = idx.gather(-1, order)
    D = state.keys.shape[-1]
    keys = state.keys.gather(2, idx[..., None].expand(*idx.shape, D))
    values = state.values.gather(2, idx[..., None].expand(*idx.shape, state.values.shape[-1]))
    return keys, values, state.log_sizes.gather(-1, idx)


def read_states(layers: list[PagedLayer], slots: Tensor, token_ids: Tensor | None, vocab,
                queries: list[Tensor | None] | None = None,
                reference: list[Tensor | None] | None = None) -> list[KVState]:
    """The prompt of every layer as an uncompressed KVState (B = 1).

    token_ids: [P] long or None; queries: per layer [W, Hq, D] (the last W prompt queries) or
    None -> extras["queries"]; reference: per layer [R, Hq, D] (queries strided over the prompt)
    or None -> extras["reference_queries"] (rotated, unscaled, as the transformers path records).
    """
    states = []
    ids = None if token_ids is None else token_ids.reshape(1, -1).long()
    for i, layer in enumerate(layers):
        k = layer.keys[slots].permute(1, 0, 2)[None]  # [1, H, P, D]
        v = layer.values[slots].permute(1, 0, 2)[None]
        state = KVState.from_raw(k.clone(), v.clone(), token_ids=ids, vocab=vocab)
        extras = dict(state.extras)
        for key, per_layer in (("queries", queries), ("reference_queries", reference)):
            q = None if per_layer is None else per_layer[i]
            if q is not None:
                extras[key] = q.permute(1, 0, 2)[None].contiguous()  # [1, Hq, W, D]
        states.append(state.replace(extras=extras))
    return states


def compress_prompt(pipeline: Pipeline, layers: list[PagedLayer], slots: Tensor, block_size: int, *,
                    token_ids: Tensor | None = None, vocab=None, queries=None, reference=None,
                    max_slots: int | None = None) -> CompactionResult:
    """Compress the prompt held at ``slots`` ([P] physical slots, in position order) in every
    layer, write the result back compacted to the end, and set the bias.

    max_slots: the most slots a layer may keep (the scheduler's block rule); a layer the pipeline
    leaves above it (a budget it could not reach) is cut to it by ``keep_within``.
    All-or-nothing: every layer is compressed before any is written.
    """
    P = int(slots.numel())
    states = read_states(layers, slots, token_ids, vocab, queries, reference)
    with scratch.compression_round():  # the core's CPU scratch buffers, handed back after the layers
        if pipeline.needs_all_layers:
            pipeline.prepare(states)
        results = [pipeline.compress(state, layer_idx)[0] for layer_idx, state in enumerate(states)]
    limit = P if max_slots is None else max_slots
    written, trimmed = [], 0
    for new in results:
        if new.num_slots > limit:
            written.append(keep_within(new, limit, pipeline.config.sinks))
            trimmed += 1
        else:
            written.append((new.keys, new.values, new.log_sizes))
    use_sizes = pipeline.config.proportional_attention
    counts = []
    for layer, (k, v, log_sizes) in zip(layers, written):
        n = k.shape[2]
        counts.append(n)
        keep = slots[P - n:]
        layer.keys[keep] = k[0].permute(1, 0, 2).to(layer.keys.dtype)
        layer.values[keep] = v[0].permute(1, 0, 2).to(layer.values.dtype)
        bias = log_sizes[0].t()  # [n, H]: the per-slot bias (log-size or fitted)
        if not use_sizes:
            bias = torch.where(bias == NEG_INF, NEG_INF, 0.0)
        layer.bias[keep] = bias.to(layer.bias.dtype)
        layer.bias[slots[: P - n]] = NEG_INF
    start = P - max(counts)
    return CompactionResult(
        slots_per_layer=counts,
        valid_slots=[float((b > NEG_INF).sum(-1).float().mean()) for _, _, b in written],
        start=start, dead_blocks=start // block_size, trimmed_layers=trimmed,
    )
