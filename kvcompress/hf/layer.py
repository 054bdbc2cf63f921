"""One layer of the compressed cache: slots with per-slot log-sizes in preallocated buffers.

A decode step writes its key/value into the next free slot of a buffer with spare capacity
(no torch.cat of the whole cache per step); a compression writes the compressed state into a
new, tightly sized buffer, so the memory of the uncompressed cache is returned.

Buffer invariant: slots [n, capacity) have log-size -inf, position -1 and finite (zero or
stale) keys/values, so attention over a view longer than n ignores them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers.cache_utils import CacheLayerMixin

from .. import decode as _decode
from ..budget import target_slots
from ..types import NEG_INF, KVState
from ..validation import require
from .attention import STEP_KEY

BUCKET = 256  # capacities and single-token attention views are multiples of this many slots
REFERENCE_QUERIES = "reference_queries"  # extras key: [B, Hq, R, D] strided prefill queries


def strided_queries(query: Tensor, count: int, seq_start: Tensor | None) -> Tensor:
    """[B, Hq, R, D]: R of the L queries strided evenly over each row's real tokens, the last
    one included (rows shorter than R repeat queries). query: [B, Hq, L, D] rotated, unscaled."""
    B, Hq, L, D = query.shape
    start = torch.zeros(B, dtype=torch.long, device=query.device) if seq_start is None else seq_start.to(query.device)
    real = (L - start).clamp(min=1).to(torch.float64)  # [B]
    frac = torch.linspace(0.0, 1.0, count, dtype=torch.float64, device=query.device) if count > 1 else \
        torch.ones(1, dtype=torch.float64, device=query.device)
    idx = start[:, None] + torch.round(frac[None, :] * (real[:, None] - 1)).long()  # [B, R]
    idx = idx.clamp(0, L - 1)
    return query.gather(2, idx[:, None, :, None].expand(B, Hq, count, D)).contiguous()


def _round_up(n: int, multiple: int = BUCKET) -> int:
    return max(multiple, -(-n // multiple) * multiple)


def _with_frontier(state: KVState, recent: int) -> KVState:
    """Mark a prefill compression's coverage the way DecodeCompressor does after a full
    compression (every token before the recent window was clustered), so its first decode-time
    compression only looks at the tail."""
    key = getattr(_decode, "FRONTIER_KEY", None)
    if key is None:
        return state
    start = max(state.num_tokens - recent, 0)
    frontier = torch.full((state.batch_size,), start, dtype=torch.long, device=state.keys.device)
    return state.replace(extras={**state.extras, key: frontier})


@dataclass
class LayerStep:
    """What the attention function needs from the layer for one forward, and the way back."""

    layer: "CompressedLayer"
    q: int
    fresh: bool  # the layer was empty: a prefill over nothing merged
    compressed: bool  # slots != tokens (merged or compacted) before this update
    log_sizes: Tensor  # [B, H, N_view] float32, -inf = padding / unused
    causal: bool
    use_sizes: bool
    backend: str
    track_attention: bool
    query_valid: Tensor | None  # [B, q] bool, False for padding queries
    done: bool = False

    def can_use_stock(self, attention_mask, num_keys: int) -> bool:
        """Stock SDPA with the model's mask is exact when no slot is merged and the mask was
        built for exactly this layer's slots."""
        if self.fresh:
            return True
        return (not self.compressed and self.q > 1 and isinstance(attention_mask, Tensor)
                and attention_mask.dim() == 4 and attention_mask.shape[-1] == num_keys)

    def abort(self) -> None:
        self.layer.cache._rollback_forward()

    def finish(self, query: Tensor, received: Tensor | None) -> None:
        self.done = True
        self.layer._after_attention(self, query, received)


class CompressedLayer(CacheLayerMixin):
    """Slots of one layer: keys/values [B, H, cap, D], log-sizes and positions [B, H, cap]."""

    is_compileable = False  # slot counts change when a layer is compressed
    is_croppable = False  # a merge cannot be undone by cropping
    is_sliding = False
    supports_early_init = False

    def __init__(self, cache, layer_idx: int):
        # CacheLayerMixin.__init__ is not called: keys/values are read-only views of the buffers
        self.cache = cache
        self.layer_idx = layer_idx
        self._k: Tensor | None = None  # [B, H, cap, D]
        self._v: Tensor | None = None
        self._ls: Tensor | None = None  # [B, H, cap] float32
        self._pos: Tensor | None = None  # [B, H, cap] long
        # per-slot statistics [B, H, cap, ...] that merging sums over members, e.g. "attn_acc"
        # (attention received, with track_attention); new slots start at 0
        self._sx: dict[str, Tensor] = {}
        self.extras: dict = {}  # other state extras a compression returned (e.g. the decode frontier)
        self.n = 0  # slots in use (padding slots of heads with fewer slots included)
        self.num_tokens = 0  # tokens seen
        self.queries: Tensor | None = None  # [B, Hq, W, D], the last W queries (query_window)
        self.compressed = False
        self._deferred = False  # prefill compression waits for the last layer (cross-layer guards)
        self.last_report = None
        self.device = None
        self._undo = None
        self._step: LayerStep | None = None

    # ------------------------------------------------------------------ views
    @property
    def is_initialized(self) -> bool:
        return self._k is not None

    @property
    def keys(self) -> Tensor | None:
        return None if self._k is None else self._k[:, :, : self.n]

    @property
    def values(self) -> Tensor | None:
        return None if self._v is None else self._v[:, :, : self.n]

    @property
    def log_sizes(self) -> Tensor | None:
        return None if self._ls is None else self._ls[:, :, : self.n]

    @property
    def positions(self) -> Tensor | None:
        return None if self._pos is None else self._pos[:, :, : self.n]

    @property
    def capacity(self) -> int:
        return 0 if self._k is None else self._k.shape[2]

    def state(self) -> KVState:
        """The layer as a KVState (views of the buffers; pipelines never write into them)."""
        require(self.is_initialized, "layer", self.layer_idx, "a layer that has seen tokens")
        extras = dict(self.extras)
        if self.queries is not None:
            extras["queries"] = self.queries
        stats = {name: buf[:, :, : self.n] for name, buf in self._sx.items()}
        cache = self.cache
        return KVState(
            keys=self.keys, values=self.values, log_sizes=self.log_sizes, positions=self.positions,
            num_tokens=self.num_tokens, token_ids=cache._ids[:, : self.num_tokens],
            seq_start=cache._seq_start, vocab=cache.vocab, extras=extras, stats=stats,
        )

    def valid_slots(self) -> Tensor:
        """[B, H] long: slots holding tokens."""
        return (self.log_sizes > NEG_INF).sum(-1)

    def nbytes(self) -> int:
        """Bytes of keys, values and log-sizes of the slots in use."""
        if self._k is None:
            return 0
        B, H, _, D = self._k.shape
        return B * H * self.n * (D * (self._k.element_size() + self._v.element_size()) + 4)

    def allocated_bytes(self) -> int:
        bufs = (self._k, self._v, self._ls, self._pos, *self._sx.values())
        return sum(t.numel() * t.element_size() for t in bufs if t is not None)

    # ------------------------------------------------------------------ CacheLayerMixin
    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        B, H, q, D = key_states.shape
        self._allocate(B, H, D, value_states.shape[-1], _round_up(q), key_states.dtype, key_states.device)

    def get_seq_length(self) -> int:
        """Tokens seen (not slots): RoPE positions and generate's prompt slicing derive from it."""
        return self.num_tokens

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # kv_length in slot space, offset = tokens no longer present as slots: the causal
        # check is then bottom-right in slot space and the 2-d padding mask lines up with
        # the new tokens
        return self.n + query_length, self.num_tokens - self.n

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.__init__(self.cache, self.layer_idx)

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove == 0:
            return
        raise ValueError(f"tokens_to_remove={tokens_to_remove} is invalid: expected 0; a compressed cache "
                         "cannot be cropped (merged slots cannot be split again)")

    def offload(self):
        raise ValueError("offloading=True is invalid for CompressedCache: expected offloading=False")

    def prefetch(self):
        raise ValueError("offloading=True is invalid for CompressedCache: expected offloading=False")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._batch_apply(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._batch_apply(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: Tensor) -> None:
        self._batch_apply(lambda t: t[indices.to(t.device) if isinstance(indices, Tensor) else indices])

    def _batch_apply(self, fn) -> None:
        if self._k is None:
            return
        B0 = self._k.shape[0]
        self._k, self._v, self._ls, self._pos = fn(self._k), fn(self._v), fn(self._ls), fn(self._pos)
        self._sx = {name: fn(buf) for name, buf in self._sx.items()}
        self.extras = {name: fn(x) if isinstance(x, Tensor) and x.dim() >= 1 and x.shape[0] == B0 else x
                       for name, x in self.extras.items()}
        if self.queries is not None:
            self.queries = fn(self.queries)

    # ------------------------------------------------------------------ buffers
    def _allocate(self, B, H, D, Dv, cap, dtype, device, slot_extras: dict | None = None) -> None:
        """New buffers of ``cap`` slots, all unused (log-size -inf). slot_extras: name -> trailing shape."""
        self.device = device
        self._k = torch.zeros(B, H, cap, D, dtype=dtype, device=device)
        self._v = torch.zeros(B, H, cap, Dv, dtype=dtype, device=device)
        self._ls = torch.full((B, H, cap), NEG_INF, dtype=torch.float32, device=device)
        self._pos = torch.full((B, H, cap), -1, dtype=torch.long, device=device)
        if slot_extras is None:
            pipe = self.cache.pipeline
            slot_extras = {"attn_acc": ((), torch.float32)} if pipe is not None and pipe.needs.attention else {}
        self._sx = {name: torch.zeros(B, H, cap, *shape, dtype=dt, device=device)
                    for name, (shape, dt) in slot_extras.items()}

    def _slot_extra_specs(self) -> dict:
        return {name: (tuple(buf.shape[3:]), buf.dtype) for name, buf in self._sx.items()}

    def _ensure_capacity(self, needed: int) -> None:
        cap = self.capacity
        if needed <= cap:
            return
        new_cap = _round_up(max(needed, cap + cap // 2))
        old = (self._k, self._v, self._ls, self._pos)
        old_sx = self._sx
        B, H, _, D = self._k.shape
        self._allocate(B, H, D, self._v.shape[-1], new_cap, self._k.dtype, self._k.device, self._slot_extra_specs())
        n = self.n
        for new, prev in zip((self._k, self._v, self._ls, self._pos), old):
            new[:, :, :n] = prev[:, :, :n]
        for name, prev in old_sx.items():
            self._sx[name][:, :, :n] = prev[:, :, :n]

    def _headroom(self) -> int:
        cfg = self.cache.config
        return (cfg.recompress_every if cfg is not None else 0) + 1

    def _set_state(self, state: KVState) -> None:
        """Write a (compressed) state into new buffers sized to it."""
        B, H, N, D = state.keys.shape
        slot_extras = dict(state.stats)
        other = {name: x for name, x in state.extras.items() if name != "queries"}  # the layer keeps its queries
        specs = self._slot_extra_specs()
        specs.update({name: (tuple(x.shape[3:]), x.dtype) for name, x in slot_extras.items()})
        self._allocate(B, H, D, state.values.shape[-1], _round_up(N + self._headroom()), state.keys.dtype,
                       state.keys.device, specs)
        self._k[:, :, :N] = state.keys
        self._v[:, :, :N] = state.values
        self._ls[:, :, :N] = state.log_sizes
        self._pos[:, :, :N] = state.positions
        for name, x in slot_extras.items():
            self._sx[name][:, :, :N] = x
        self.extras = other
        self.n = N
        self.compressed = True

    # ------------------------------------------------------------------ update (called by the attention module)
    def _check_states(self, key_states: Tensor, value_states: Tensor) -> None:
        require(key_states.dim() == 4 and value_states.dim() == 4 and key_states.shape[:3] == value_states.shape[:3],
                "key_states/value_states", (tuple(key_states.shape), tuple(value_states.shape)),
                "[B, H, q, D] tensors with the same B, H, q")
        geo = self.cache.geometry
        B, H, q, D = key_states.shape
        if geo is not None:
            require(H == geo.num_kv_heads and D == geo.head_dim, "key_states", tuple(key_states.shape),
                    f"H={geo.num_kv_heads} KV heads and head_dim {geo.head_dim}: this cache was created for "
                    f"{geo.describe()}; it cannot be reused with another model")
        if self._k is not None:
            b0, h0, _, d0 = self._k.shape
            require((B, H, D) == (b0, h0, d0), "key_states", tuple(key_states.shape),
                    f"batch {b0}, {h0} heads, head_dim {d0} as in the states already cached in layer "
                    f"{self.layer_idx} (a cache cannot be reused with another model or batch)")
            require(key_states.dtype == self._k.dtype and value_states.dtype == self._v.dtype,
                    "key_states.dtype", key_states.dtype, f"{self._k.dtype}, the dtype of the cached states")
            require(key_states.device == self._k.device, "key_states.device", str(key_states.device),
                    f"{self._k.device}, the device of the cached states")
        require(key_states.is_floating_point(), "key_states.dtype", key_states.dtype, "a floating-point dtype")

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """Append q new tokens and return the keys/values the attention function reads.

        key_states, value_states: [B, H, q, D], keys already rotated (RoPE)
        kwargs["kwargs"]:         the attention module's kwargs dict; a LayerStep is put into it
        """
        attn_kwargs = kwargs.get("kwargs")
        require(isinstance(attn_kwargs, dict), "model", type(self).__name__,
                "an attention module that passes its kwargs to cache.update(..., kwargs=kwargs) "
                "(transformers 5.x Llama-family models); this model's attention does not")
        cache = self.cache
        B, H, q, D = key_states.shape
        try:
            self._check_states(key_states, value_states)
            fwd = cache._forward_for_layer(self.layer_idx, B, q, key_states.device)
        except ValueError:
            cache._rollback_forward()  # the layers already updated in this forward go back too
            raise
        self._save_undo(fwd.index)
        fresh = self.n == 0 and self.num_tokens == 0
        compressed_before = self.compressed
        if self._k is None:
            cap = q + (BUCKET if cache.pipeline is None else 0)
            self._allocate(B, H, D, value_states.shape[-1], _round_up(cap), key_states.dtype, key_states.device)
        self._ensure_capacity(self.n + q)

        pad = fwd.pad  # [B, q] bool, True = padding
        k, v = key_states, value_states
        sl = slice(self.n, self.n + q)
        pos = torch.arange(self.num_tokens, self.num_tokens + q, device=k.device).expand(B, H, q)
        if pad is not None:
            # pad tokens: never attended (-inf) and zeroed, so nothing non-finite can leak in
            k = k.masked_fill(pad[:, None, :, None], 0)
            v = v.masked_fill(pad[:, None, :, None], 0)
            self._ls[:, :, sl] = torch.where(pad, NEG_INF, 0.0)[:, None, :].expand(B, H, q)
            self._pos[:, :, sl] = pos.masked_fill(pad[:, None, :], -1)
        else:
            self._ls[:, :, sl] = 0.0
            self._pos[:, :, sl] = pos
        self._k[:, :, sl] = k
        self._v[:, :, sl] = v
        for buf in self._sx.values():
            buf[:, :, sl] = 0
        self.n += q
        self.num_tokens += q

        # single-token steps attend over a bucketed view (unused slots are -inf), so attention
        # shapes change only every BUCKET slots; multi-token inputs need the exact slot count for
        # the bottom-right causal mask
        view = self.n if (q > 1 or fresh) else min(_round_up(self.n), self.capacity)
        cfg = cache.config
        step = LayerStep(
            layer=self, q=q, fresh=fresh, compressed=compressed_before, log_sizes=self._ls[:, :, :view],
            causal=q > 1, use_sizes=cfg.proportional_attention if cfg is not None else True,
            backend=cache.backend, track_attention="attn_acc" in self._sx,
            query_valid=None if pad is None else ~pad,
        )
        self._step = step
        attn_kwargs[STEP_KEY] = step
        return self._k[:, :, :view], self._v[:, :, :view]

    # ------------------------------------------------------------------ after attention
    def _after_attention(self, step: LayerStep, query: Tensor, received: Tensor | None) -> None:
        pipe = self.cache.pipeline
        needs = None if pipe is None else pipe.needs
        if needs is not None and needs.query_window > 0:
            q = query.detach()
            q = q if self.queries is None else torch.cat([self.queries, q], dim=2)
            self.queries = q[:, :, -needs.query_window:].contiguous()
        if needs is not None and needs.reference_queries > 0 and step.fresh:
            self.extras[REFERENCE_QUERIES] = strided_queries(query.detach(), needs.reference_queries,
                                                             self.cache._seq_start)
        if received is not None:
            self._sx["attn_acc"][:, :, : received.shape[-1]] += received
        try:
            self._maybe_compress(step)
        except BaseException:
            self.cache._rollback_forward()
            raise

    def _maybe_compress(self, step: LayerStep) -> None:
        cache = self.cache
        if cache.pipeline is None or not cache.enabled:
            return
        if not step.fresh and not self._may_exceed_budget():
            return  # the common decode step: no KVState, no tensor op
        state = self.state()
        if not step.fresh and not cache.decoder.should_compress(state, self.layer_idx):
            return
        if bool((state.real_tokens() <= 0).all()):
            return
        if step.fresh and cache.pipeline.needs_all_layers:
            self._deferred = True  # cross-layer guards decide from every layer: wait for the last one
            if self.layer_idx == len(cache.layers) - 1:
                self._compress_deferred()
            return
        start = time.perf_counter()
        if step.fresh:
            new_state, report = cache.pipeline.compress(state, self.layer_idx)
            new_state = _with_frontier(new_state, cache.config.recent)
        else:
            new_state, report = cache.decoder.compress(state, self.layer_idx)
        self._install(new_state, report)
        cache._record_compression(time.perf_counter() - start, prefill=step.fresh)

    def _compress_deferred(self) -> None:
        """Prefill compression of every waiting layer, after the pipeline's cross-layer guards
        have seen all of them. All-or-nothing: the new states are installed only when every
        layer compressed (an error leaves every layer as it was, and the forward rolls back)."""
        cache = self.cache
        layers = [layer for layer in cache.layers if layer._deferred]
        start = time.perf_counter()
        cache.pipeline.prepare([layer.state() for layer in layers])
        done = []
        for layer in layers:
            new_state, report = cache.pipeline.compress(layer.state(), layer.layer_idx)
            done.append((layer, _with_frontier(new_state, cache.config.recent), report))
        for layer, new_state, report in done:
            layer._deferred = False
            layer._install(new_state, report)
        seconds = time.perf_counter() - start
        for _ in done:
            cache._record_compression(seconds / len(done), prefill=True)

    def _install(self, new_state: KVState, report) -> None:
        self._set_state(new_state)
        self.last_report = report
        if self._k.device.type == "cuda":
            torch.cuda.synchronize(self._k.device)  # kernels are asynchronous: time them whole

    def _may_exceed_budget(self) -> bool:
        """False when no head can hold more than budget + g slots: every head holds at most n
        slots and every row's budget is at least that of the row with the fewest real tokens."""
        cfg = self.cache.config
        limit = target_slots(self.num_tokens - self.cache._max_left_pad, cfg.keep_ratio, cfg.max_slots)
        return self.n > limit + cfg.recompress_every

    # ------------------------------------------------------------------ undo for a failed forward
    def _save_undo(self, forward_index: int) -> None:
        if self._undo is not None and self._undo[0] == forward_index:
            return
        # references, not copies: appends write past n and compressions allocate new buffers;
        # only the per-slot statistics are updated in place, so they are cloned
        sx = {name: buf[:, :, : self.n].clone() for name, buf in self._sx.items()}
        self._undo = (forward_index, self._k, self._v, self._ls, self._pos, dict(self._sx), sx, self.n,
                      self.num_tokens, self.queries, self.compressed, self.last_report, dict(self.extras))

    def _commit(self) -> None:
        self._undo = None
        self._step = None

    def _rollback(self) -> None:
        if self._undo is None:
            return
        (_, self._k, self._v, self._ls, self._pos, self._sx, sx, self.n, self.num_tokens, self.queries,
         self.compressed, self.last_report, self.extras) = self._undo
        self._undo = None
        self._step = None
        self._deferred = False
        if self._k is None:
            self.device = None
            return
        self._ls[:, :, self.n:] = NEG_INF
        self._pos[:, :, self.n:] = -1
        for name, saved in sx.items():
            self._sx[name][:, :, : self.n] = saved
            self._sx[name][:, :, self.n:] = 0
