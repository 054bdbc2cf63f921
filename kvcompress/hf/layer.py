"""One layer of the compressed cache: storage only (append, expose, install a state).

Slots with per-slot biases (log-sizes) live in preallocated buffers. An append writes the new
keys/values into the next free slots of a buffer with spare capacity (no torch.cat of the whole
cache per step); ``install`` writes a (compressed) state into a new, tightly sized buffer, so
the memory of the uncompressed cache is returned. The layer never decides anything and never
calls its cache: ``CompressedCache`` appends, reads states, installs them and takes snapshots.

Buffer invariant: slots [n, capacity) have log-size -inf, position -1 and finite (zero or
stale) keys/values, so attention over a view longer than n ignores them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from transformers.cache_utils import CacheLayerMixin

from ..budget import LAYER_SCALE
from ..types import NEG_INF, KVState
from ..validation import require

BUCKET = 256  # capacities and single-token attention views are multiples of this many slots
QUERIES = "queries"  # extras key: [B, Hq, W, D] the last W queries (kept by the layer itself)


def _round_up(n: int, multiple: int = BUCKET) -> int:
    return max(multiple, -(-n // multiple) * multiple)


@dataclass(frozen=True)
class LayerSnapshot:
    """Everything a forward may change in a layer, to put it back if the forward fails.

    Buffers are kept by reference: appends write past ``n`` and installs allocate new buffers;
    only the per-slot statistics are updated in place, so their used part is cloned.
    """

    buffers: tuple  # (keys, values, log_sizes, positions) or Nones
    stat_buffers: dict
    stat_values: dict  # name -> [B, H, n, ...] clone
    n: int
    num_tokens: int
    queries: Tensor | None
    extras: dict
    compressed: bool
    last_report: object
    device: object
    counts: Tensor | None = None  # the token-count buffer, when the layer keeps one


class CompressedLayer(CacheLayerMixin):
    """Slots of one layer: keys/values [B, H, cap, D], log-sizes and positions [B, H, cap].

    stat_specs: per-slot statistics kept in buffers, name -> (trailing shape, dtype); new slots
                start at 0 (e.g. {"attn_acc": ((), torch.float32)})
    """

    is_compileable = False  # slot counts change when a layer is compressed
    is_croppable = False  # a merge cannot be undone by cropping
    is_sliding = False
    supports_early_init = False

    def __init__(self, layer_idx: int, stat_specs: dict | None = None):
        # CacheLayerMixin.__init__ is not called: keys/values are read-only views of the buffers
        self.layer_idx = layer_idx
        self.stat_specs = dict(stat_specs or {})
        self._k: Tensor | None = None  # [B, H, cap, D]
        self._v: Tensor | None = None
        self._ls: Tensor | None = None  # [B, H, cap] float32
        self._pos: Tensor | None = None  # [B, H, cap] long
        self._sx: dict[str, Tensor] = {}  # per-slot statistics [B, H, cap, ...]
        # [B, H, cap] float32 tokens per slot, kept only once a state whose counts differ from
        # exp(log_sizes) is installed (a fitted bias): otherwise exp(bias) is the count
        self._cnt: Tensor | None = None
        self.extras: dict = {}  # carried data of the layer's state (decode frontier, reference queries, ...)
        self.n = 0  # slots in use (padding slots of heads with fewer slots included)
        self.num_tokens = 0  # tokens seen
        self.queries: Tensor | None = None  # [B, Hq, W, D], the last W queries
        self._share_read: tuple | None = None  # (extras[LAYER_SCALE] tensor, its smallest row as a float)
        self.compressed = False  # slots != tokens since an install
        self.last_report = None
        self.device = None

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

    def state(self, token_ids: Tensor | None, seq_start: Tensor | None, vocab) -> KVState:
        """The layer as a KVState (views of the buffers; pipelines never write into them).

        token_ids: [B, >= T] ids of the tokens seen; seq_start: [B] or None; vocab: token texts
        """
        require(self.is_initialized, "layer", self.layer_idx, "a layer that has seen tokens")
        extras = dict(self.extras)
        if self.queries is not None:
            extras[QUERIES] = self.queries
        stats = {name: buf[:, :, : self.n] for name, buf in self._sx.items()}
        return KVState(
            keys=self.keys, values=self.values, log_sizes=self.log_sizes, positions=self.positions,
            counts=None if self._cnt is None else self._cnt[:, :, : self.n],
            num_tokens=self.num_tokens, token_ids=None if token_ids is None else token_ids[:, : self.num_tokens],
            seq_start=seq_start, vocab=vocab, extras=extras, stats=stats,
        )

    def attention_view(self, q: int, fresh: bool) -> tuple[Tensor, Tensor, Tensor]:
        """(keys, values, log_sizes) the attention reads after an append of q tokens.

        Single-token steps attend over a bucketed view (unused slots are -inf), so attention
        shapes change only every BUCKET slots; multi-token inputs need the exact slot count for
        the bottom-right causal mask.
        """
        view = self.n if (q > 1 or fresh) else min(_round_up(self.n), self.capacity)
        return self._k[:, :, :view], self._v[:, :, :view], self._ls[:, :, :view]

    def budget_share(self) -> float | None:
        """The layer's share of the budget (``extras[LAYER_SCALE]``, the smallest row's) or None
        for an even split; read from the tensor once per state installed, not once per decode step."""
        scale = self.extras.get(LAYER_SCALE)
        if scale is None:
            return None
        if self._share_read is None or self._share_read[0] is not scale:
            self._share_read = (scale, float(scale.min()))
        return self._share_read[1]

    def valid_slots(self) -> Tensor:
        """[B, H] long: slots holding tokens."""
        return (self.log_sizes > NEG_INF).sum(-1)

    def nbytes(self) -> int:
        """Bytes of keys, values, log-sizes (and token counts, when kept) of the slots in use."""
        if self._k is None:
            return 0
        B, H, _, D = self._k.shape
        per_slot = D * (self._k.element_size() + self._v.element_size()) + 4 + (4 if self._cnt is not None else 0)
        return B * H * self.n * per_slot

    def allocated_bytes(self) -> int:
        bufs = (self._k, self._v, self._ls, self._pos, self._cnt, *self._sx.values())
        return sum(t.numel() * t.element_size() for t in bufs if t is not None)

    def full_bytes(self) -> int:
        """Bytes a stock (uncompressed) layer would hold for the tokens seen."""
        if self._k is None:
            return 0
        B, H, _, D = self._k.shape
        return B * H * self.num_tokens * D * (self._k.element_size() + self._v.element_size())

    # ------------------------------------------------------------------ CacheLayerMixin
    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        B, H, q, D = key_states.shape
        self._allocate(B, H, D, value_states.shape[-1], _round_up(q), key_states.dtype, key_states.device)

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs):
        raise ValueError("CompressedLayer.update is invalid: expected CompressedCache.update(keys, values, "
                         "layer_idx, ...) (the cache schedules its layers)")

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
        self.__init__(self.layer_idx, self.stat_specs)

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
        self.batch_apply(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.batch_apply(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: Tensor) -> None:
        self.batch_apply(lambda t: t[indices.to(t.device) if isinstance(indices, Tensor) else indices])

    def batch_apply(self, fn) -> None:
        """Apply ``fn`` to every per-row tensor (beam search: reorder, repeat, select rows)."""
        if self._k is None:
            return
        B0 = self._k.shape[0]
        self._k, self._v, self._ls, self._pos = fn(self._k), fn(self._v), fn(self._ls), fn(self._pos)
        self._sx = {name: fn(buf) for name, buf in self._sx.items()}
        if self._cnt is not None:
            self._cnt = fn(self._cnt)
        self.extras = {name: fn(x) if isinstance(x, Tensor) and x.dim() >= 1 and x.shape[0] == B0 else x
                       for name, x in self.extras.items()}
        if self.queries is not None:
            self.queries = fn(self.queries)

    # ------------------------------------------------------------------ buffers
    def _allocate(self, B, H, D, Dv, cap, dtype, device) -> None:
        """New buffers of ``cap`` slots, all unused (log-size -inf)."""
        self.device = device
        self._k = torch.zeros(B, H, cap, D, dtype=dtype, device=device)
        self._v = torch.zeros(B, H, cap, Dv, dtype=dtype, device=device)
        self._ls = torch.full((B, H, cap), NEG_INF, dtype=torch.float32, device=device)
        self._pos = torch.full((B, H, cap), -1, dtype=torch.long, device=device)
        self._sx = {name: torch.zeros(B, H, cap, *shape, dtype=dt, device=device)
                    for name, (shape, dt) in self.stat_specs.items()}

    def _ensure_capacity(self, needed: int) -> None:
        cap = self.capacity
        if needed <= cap:
            return
        new_cap = _round_up(max(needed, cap + cap // 2))
        old = (self._k, self._v, self._ls, self._pos)
        old_sx, old_cnt = self._sx, self._cnt
        B, H, _, D = self._k.shape
        self._allocate(B, H, D, self._v.shape[-1], new_cap, self._k.dtype, self._k.device)
        n = self.n
        if old_cnt is not None:
            self._cnt = torch.zeros(B, H, new_cap, dtype=torch.float32, device=self._k.device)
            self._cnt[:, :, :n] = old_cnt[:, :, :n]
        for new, prev in zip((self._k, self._v, self._ls, self._pos), old):
            new[:, :, :n] = prev[:, :, :n]
        for name, prev in old_sx.items():
            self._sx[name][:, :, :n] = prev[:, :, :n]

    def append(self, keys: Tensor, values: Tensor, pad: Tensor | None, spare: int = 0) -> None:
        """Append q new tokens: keys/values [B, H, q, D] (rotated), pad [B, q] bool (True = left
        padding: never attended, zeroed) or None. ``spare``: extra capacity of a first buffer."""
        B, H, q, D = keys.shape
        if self._k is None:
            self._allocate(B, H, D, values.shape[-1], _round_up(q + spare), keys.dtype, keys.device)
        self._ensure_capacity(self.n + q)
        sl = slice(self.n, self.n + q)
        pos = torch.arange(self.num_tokens, self.num_tokens + q, device=keys.device).expand(B, H, q)
        if pad is not None:
            keys = keys.masked_fill(pad[:, None, :, None], 0)
            values = values.masked_fill(pad[:, None, :, None], 0)
            self._ls[:, :, sl] = torch.where(pad, NEG_INF, 0.0)[:, None, :].expand(B, H, q)
            self._pos[:, :, sl] = pos.masked_fill(pad[:, None, :], -1)
        else:
            self._ls[:, :, sl] = 0.0
            self._pos[:, :, sl] = pos
        self._k[:, :, sl] = keys
        self._v[:, :, sl] = values
        for buf in self._sx.values():
            buf[:, :, sl] = 0
        if self._cnt is not None:
            self._cnt[:, :, sl] = 1.0 if pad is None else (~pad).float()[:, None, :].expand(B, H, q)
        self.n += q
        self.num_tokens += q

    def add_stat(self, name: str, delta: Tensor) -> None:
        """Add delta [B, H, n', ...] (n' <= n) to the first n' slots of a per-slot statistic."""
        require(name in self._sx, "stat", name, f"one of the layer's statistics {sorted(self._sx)}")
        self._sx[name][:, :, : delta.shape[2]] += delta

    def keep_queries(self, queries: Tensor, window: int) -> None:
        """Roll the last ``window`` queries [B, Hq, W, D] forward with this forward's queries."""
        q = queries if self.queries is None else torch.cat([self.queries, queries], dim=2)
        self.queries = q[:, :, -window:].contiguous()

    def install(self, state: KVState, headroom: int) -> None:
        """Write ``state`` into new buffers sized to it (+ headroom slots): keys, values, biases,
        positions, its per-slot stats and carried extras (its "queries" replace the layer's)."""
        B, H, N, D = state.keys.shape
        specs = dict(self.stat_specs)
        specs.update({name: (tuple(x.shape[3:]), x.dtype) for name, x in state.stats.items()})
        self.stat_specs = specs
        self._allocate(B, H, D, state.values.shape[-1], _round_up(N + headroom), state.keys.dtype,
                       state.keys.device)
        self._k[:, :, :N] = state.keys
        self._v[:, :, :N] = state.values
        self._ls[:, :, :N] = state.log_sizes
        self._pos[:, :, :N] = state.positions
        for name, x in state.stats.items():
            self._sx[name][:, :, :N] = x
        self._cnt = None
        if state.counts is not None and not torch.equal(state.token_counts(), state.log_sizes.exp()):
            self._cnt = torch.zeros(B, H, self.capacity, dtype=torch.float32, device=state.keys.device)
            self._cnt[:, :, :N] = state.token_counts()
        extras = dict(state.extras)
        queries = extras.pop(QUERIES, None)
        if queries is not None:
            self.queries = queries
        self.extras = extras
        self.n = N
        self.num_tokens = state.num_tokens
        self.compressed = True

    def set_stat(self, name: str, value: Tensor) -> None:
        """Set a per-slot statistic: value [B, H, n, ...] (new slots will start at 0)."""
        require(self.is_initialized, "layer", self.layer_idx, "a layer that has seen tokens")
        B, H = self._k.shape[:2]
        require(isinstance(value, Tensor) and value.dim() >= 3 and tuple(value.shape[:3]) == (B, H, self.n),
                f"stats[{name!r}] of layer {self.layer_idx}", tuple(getattr(value, "shape", ())),
                f"a tensor [B={B}, H={H}, N={self.n}, ...] (one value per slot)")
        buf = torch.zeros(B, H, self.capacity, *value.shape[3:], dtype=value.dtype, device=self._k.device)
        buf[:, :, : self.n] = value
        self._sx[name] = buf
        self.stat_specs[name] = (tuple(value.shape[3:]), value.dtype)

    def drop_stat(self, name: str) -> None:
        """Forget the per-slot statistic ``name`` (its buffer is freed)."""
        self._sx.pop(name, None)
        self.stat_specs.pop(name, None)

    # ------------------------------------------------------------------ snapshots
    def snapshot(self) -> LayerSnapshot:
        stats = {name: buf[:, :, : self.n].clone() for name, buf in self._sx.items()}
        return LayerSnapshot((self._k, self._v, self._ls, self._pos), dict(self._sx), stats, self.n,
                             self.num_tokens, self.queries, dict(self.extras), self.compressed, self.last_report,
                             self.device, self._cnt)

    def restore(self, snap: LayerSnapshot) -> None:
        self._k, self._v, self._ls, self._pos = snap.buffers
        self._sx = dict(snap.stat_buffers)
        self._cnt = snap.counts
        self.stat_specs.update({name: (tuple(b.shape[3:]), b.dtype) for name, b in self._sx.items()})
        self.n, self.num_tokens, self.queries = snap.n, snap.num_tokens, snap.queries
        self.extras, self.compressed, self.last_report, self.device = dict(snap.extras), snap.compressed, \
            snap.last_report, snap.device
        if self._k is None:
            return
        self._ls[:, :, self.n:] = NEG_INF
        self._pos[:, :, self.n:] = -1
        for name, saved in snap.stat_values.items():
            self._sx[name][:, :, : self.n] = saved
            self._sx[name][:, :, self.n:] = 0


__all__ = ["CompressedLayer", "LayerSnapshot", "BUCKET", "QUERIES"]
