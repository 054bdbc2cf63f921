"""When each layer of a ``CompressedCache`` compresses: one scheduler per cache.

- Prefill end (the forward that fills an empty layer): the layer is compressed by the pipeline as
  soon as its attention is recorded, so the uncompressed prompt of one layer at a time is held;
  or, when the pipeline ``needs.all_layers`` (cross-layer guards, a model pass) or the cache has
  prefill hooks, every layer waits for the forward's end: the hooks run ``fn(cache, model)``,
  the cross-layer guards see every layer, then all layers compress, all or nothing.
- Decode time: a layer that holds more than budget + g slots (g = ``recompress_every``) is
  compressed back by ``DecodeCompressor``.
- A prefill chunk (``cache.prefill(ids, chunk=C)``, a forward on layers compressed already):
  the decode rule, right after each layer's attention; or, when the pipeline ``needs.all_layers``,
  at the forward's end: the cross-layer guards decide for the chunk's tokens from every layer,
  then every layer compresses back to its budget, all or nothing.
- ``cache.compress()``: every layer now (prefill rule for layers never compressed, decode rule
  for the others), all or nothing.

The scheduler reads and installs layer states through the cache's public methods; it never
touches the attention function. A compression round (every layer of one forward, or one
``compress()`` call) reuses the core's scratch buffers from layer to layer; when the round ends
the scheduler hands them back (``scratch.compression_round``), so a compressed cache holds no memory beyond
its own slots.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from ..budget import smallest_share, target_slots
from ..decode import FRONTIER_KEY, DecodeCompressor
from ..pipeline import Pipeline
from ..protocols import Needs
from ..strategies import scratch
from ..types import KVState


def with_frontier(state: KVState, recent: int) -> KVState:
    """Mark a prefill compression's coverage the way DecodeCompressor does after a full
    compression (every token before the recent window was clustered), so its first decode-time
    compression only looks at the tail."""
    start = max(state.num_tokens - recent, 0)
    frontier = torch.full((state.batch_size,), start, dtype=torch.long, device=state.keys.device)
    return state.replace(extras={**state.extras, FRONTIER_KEY: frontier})


def slots_of(tokens: Tensor | None, state: KVState) -> Tensor | None:
    """[B, H, N] bool: the valid slots of ``state`` whose position is marked in ``tokens`` [B, T]
    bool (None: None)."""
    if tokens is None:
        return None
    B, H, N = state.valid.shape
    T = tokens.shape[1]
    padded = torch.cat([tokens.to(state.keys.device), tokens.new_zeros(B, 1).to(state.keys.device)], dim=1)
    index = torch.where(state.valid, state.positions, T).reshape(B, H * N)  # [B, H * N]; T: padding
    return padded.gather(1, index).reshape(B, H, N) & state.valid


class Scheduler:
    """pipeline: the cache's Pipeline or None (no compression); record: Needs recorded on top."""

    def __init__(self, pipeline: Pipeline | None, record: Needs | None = None):
        self.pipeline = pipeline
        self.decoder = None if pipeline is None else DecodeCompressor(pipeline)
        self.needs = (Needs() if pipeline is None else pipeline.needs) | (record or Needs())

    @property
    def headroom(self) -> int:
        """Spare slots an installed state gets: one decode period plus one."""
        return (0 if self.pipeline is None else self.pipeline.config.recompress_every) + 1

    def defers_prefill(self, cache) -> bool:
        return self.needs.all_layers or bool(cache.prefill_hooks)

    # ------------------------------------------------------------------ per layer, after its attention
    def after_attention(self, cache, layer_idx: int, fresh: bool) -> None:
        """Compress layer ``layer_idx`` now if its rule says so (or mark it for the forward's end);
        after the forward's last compressed layer, the round's scratch goes back."""
        if self.pipeline is None or not cache.enabled:
            return
        try:
            self._layer_rule(cache, layer_idx, fresh)
        finally:
            ids = cache.compressed_layer_ids()
            if ids and layer_idx == ids[-1] and scratch.pooled_bytes():
                scratch.clear()

    def _layer_rule(self, cache, layer_idx: int, fresh: bool) -> None:
        layer = cache.layers[layer_idx]
        if fresh:
            if self.defers_prefill(cache):
                cache._deferred.append(layer_idx)
                return
            state = cache.layer_state(layer_idx)
            if bool((state.real_tokens() <= 0).all()):
                return
            start = time.perf_counter()
            new_state, report = self.pipeline.compress(state, layer_idx)
            cache._install(layer_idx, with_frontier(new_state, self.pipeline.config.recent), report)
            cache._record_compression(time.perf_counter() - start, prefill=True)
            return
        chunk = cache._chunk_start is not None
        if chunk and self.defers_prefill(cache):
            cache._chunk_deferred.append(layer_idx)
            return
        if not chunk and not self._may_exceed_budget(cache, layer):
            return  # the common decode step: no KVState, no tensor op
        state = cache.layer_state(layer_idx)
        if not self.decoder.should_compress(state, layer_idx, slack=0 if chunk else None):
            return
        start = time.perf_counter()
        new_state, report = self.decoder.compress(state, layer_idx)
        cache._install(layer_idx, new_state, report)
        cache._record_compression(time.perf_counter() - start, prefill=chunk)

    def compress_chunk(self, cache, layer_ids: list[int], chunk_start: int) -> None:
        """A prefill chunk's end (pipelines that need all layers, or caches with prefill hooks):
        the hooks run, the cross-layer guards decide for the tokens from ``chunk_start`` on from
        every layer, then each layer over its budget compresses back to it (all or nothing: the
        forward is undone on an error)."""
        if self.pipeline is None or not layer_ids:
            return
        cache._run_prefill_hooks()
        start = time.perf_counter()
        states = {i: cache.layer_state(i) for i in layer_ids}
        self.decoder.prepare_chunk(list(states.values()), chunk_start)
        done = 0
        # layer by layer, each installed at once so that only one layer holds two copies; on an
        # error the forward's snapshot puts every layer back (the cache undoes the whole chunk)
        with scratch.compression_round():
            for i in layer_ids:
                state = states.pop(i)
                if self.decoder.should_compress(state, i, slack=0):
                    new_state, report = self.decoder.compress(state, i)
                    del state
                    cache._install(i, new_state, report)
                    done += 1
        seconds = time.perf_counter() - start
        for _ in range(done):
            cache._record_compression(seconds / done, prefill=True)

    def _may_exceed_budget(self, cache, layer) -> bool:
        """False when no head can hold more than budget + g slots: every head holds at most n
        slots and every row's budget is at least that of the row with the fewest real tokens."""
        cfg = self.pipeline.config
        limit = target_slots(layer.num_tokens - cache._max_left_pad, cfg.keep_ratio, cfg.max_slots)
        limit = smallest_share(limit, layer.budget_share())  # a layer with its own share of the budget
        return layer.n > limit + cfg.recompress_every

    # ------------------------------------------------------------------ every layer at once
    def compress_prefill(self, cache, layer_ids: list[int], protect: Tensor | None = None) -> None:
        """Prefill compression of ``layer_ids`` after the prefill hooks and the pipeline's
        cross-layer guards have seen all of them; installs only when every layer compressed.
        protect: [B, T] bool tokens no layer merges or drops in this compression, or None."""
        if self.pipeline is None or not layer_ids:
            return
        start = time.perf_counter()
        states = {i: cache.layer_state(i) for i in layer_ids}
        states = {i: s for i, s in states.items() if not bool((s.real_tokens() <= 0).all())}
        if not states:
            return
        self.pipeline.prepare(list(states.values()))
        done = []
        with scratch.compression_round():
            for i, state in states.items():
                new_state, report = self.pipeline.compress(state, i, protect=slots_of(protect, state))
                done.append((i, with_frontier(new_state, self.pipeline.config.recent), report))
        for i, new_state, report in done:
            cache._install(i, new_state, report)
        seconds = time.perf_counter() - start
        for _ in done:
            cache._record_compression(seconds / len(done), prefill=True)

    def compress_all(self, cache, protect: Tensor | None = None) -> None:
        """``cache.compress()``: layers never compressed by the prefill rule, the others back to
        their decode-time budget. protect: [B, T] bool tokens kept as they are, or None."""
        if self.pipeline is None:
            return
        fresh = [i for i in cache.compressed_layer_ids() if not cache.layers[i].compressed]
        if fresh:
            cache._run_prefill_hooks()
            self.compress_prefill(cache, fresh, protect)
        with scratch.compression_round():
            for i in cache.compressed_layer_ids():
                if i in fresh:
                    continue
                start = time.perf_counter()
                state = cache.layer_state(i)
                new_state, report = self.decoder.compress(state, i, protect=slots_of(protect, state))
                cache._install(i, new_state, report)
                cache._record_compression(time.perf_counter() - start, prefill=False)
