"""CompressedCache: a transformers ``Cache`` whose layers hold merged slots with per-slot biases.

    with CompressedCache.for_model(model, tokenizer, "semanticache", keep_ratio=0.5) as cache:
        out = model.generate(**inputs, cache=cache, max_new_tokens=64)  # past_key_values= before the rename
    # leaving the block (or close()) removes the hooks and restores the attention implementation

A document compressed once, many questions (each from its own copy):

    cache = CompressedCache.for_model(model, tokenizer, "semanticache", keep_ratio=0.25)
    model.base_model(input_ids=doc_ids, cache=cache)          # prefill + compress the document
    for q_ids in questions:
        answer = model.generate(input_ids=torch.cat([doc_ids, q_ids], 1), cache=copy.deepcopy(cache))

``for_model`` registers the kvcompress attention implementations, switches the model to
"kvcompress" (which behaves exactly like "sdpa" for any other cache) and installs a forward
pre-hook and hook on the model's base model. The hooks record, for every forward that uses this
cache, the token ids (text-aware chunkers need them) and which new tokens are left padding (those
get bias -inf and can never be attended, even after merging).

Who does what: each ``CompressedLayer`` is storage; the attention function attends and records
what the pipeline's ``needs`` ask for (queries, attention received) into the request this cache
hands it; the cache's ``Scheduler`` (kvcompress.hf.schedule) decides when each layer compresses:
at the prefill's end (per layer, or all layers at the forward's end for cross-layer guards,
model passes and prefill hooks), and at decode time when a layer exceeds its budget by
``recompress_every`` slots. A forward that fails (e.g. a budget that cannot be met) leaves the
cache as it was before that forward (a ``CacheSnapshot``).

Sliding-window layers (Gemma 2/3, Mistral with a window, ...) are transformers' own
``DynamicSlidingWindowLayer`` (already bounded, attended by stock SDPA); full-attention layers
are compressed. ``get_seq_length()`` is the number of TOKENS SEEN, not slots.

Statistics for scorers (``pipeline.needs``): ``query_window=W`` -> each layer's state carries its
last W post-RoPE queries in ``extras["queries"]`` [B, H_q, W, D]; ``reference_queries=R`` -> R
prefill queries strided over the prompt in ``extras["reference_queries"]``; ``attention`` ->
the attention each slot received (prefill and decoding) in ``stats["attn_acc"]`` [B, H_kv, N].

Beam search: let generate prefill (it expands the prompt, the cache follows), or call
``cache.batch_repeat_interleave(num_beams)`` on a cache you prefilled yourself.
"""

from __future__ import annotations

import copy
import inspect
import weakref
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import torch
from torch import Tensor
from transformers.cache_utils import Cache, DynamicSlidingWindowLayer

from ..config import PipelineConfig, as_config
from ..pipeline import Pipeline
from ..protocols import Needs
from ..types import KVState
from ..validation import check_int, require
from .attention import ACTIVE_CACHE, REQUEST_KEY, AttentionRequest, register_attention
from .backends import Backends, compile_count
from .layer import BUCKET, CompressedLayer, LayerSnapshot, _round_up
from .schedule import Scheduler
from .support import ATTN_AUTO, ATTN_NAMES, ModelGeometry, check_supported, sliding_windows
from .vocab import token_texts

REFERENCE_QUERIES = "reference_queries"
ATTN_ACC = "attn_acc"


@dataclass(frozen=True)
class CacheSnapshot:
    """The cache before a forward (or a compress()): inputs bookkeeping and every layer touched."""

    ids: Tensor | None
    seq_start: Tensor | None
    max_left_pad: int
    layers: dict = field(default_factory=dict)  # layer_idx -> LayerSnapshot, or a sliding layer's __dict__
    reports: tuple = ()
    stats: dict = field(default_factory=dict)


@dataclass
class _Forward:
    index: int
    q: int
    batch: int
    pad: Tensor | None  # [B, q] bool, True = padding token
    snapshot: CacheSnapshot
    done: set = field(default_factory=set)
    requests: dict = field(default_factory=dict)  # layer_idx -> (AttentionRequest, fresh)
    token: object = None  # ACTIVE_CACHE token of a bound forward
    ending: bool = False


def _as_pipeline(pipeline, overrides) -> Pipeline | None:
    if pipeline is None:
        require(not overrides, "overrides", sorted(overrides), "none when pipeline=None (no compression)")
        return None
    if isinstance(pipeline, Pipeline):
        return Pipeline(pipeline.config, **overrides) if overrides else pipeline
    require(isinstance(pipeline, (str, Mapping, PipelineConfig)), "pipeline", pipeline,
            "a preset name, a dict, a PipelineConfig, a Pipeline or None")
    return Pipeline(as_config(pipeline, **overrides))


def _is_hook(fn) -> bool:
    return getattr(fn, "_kvcompress_cache_hook", False)


# model -> the attention implementation it had before a cache switched it to kvcompress; the
# entry lives as long as the model and is removed when the last cache bound to it is released
_SWITCHED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _release(handles, model_ref) -> None:
    """Remove a cache's hooks; restore the attention implementation when no other cache is bound."""
    for handle in handles:
        handle.remove()
    model = None if model_ref is None else model_ref()
    if model is None or any(_is_hook(h) for h in model.base_model._forward_pre_hooks.values()):
        return
    before = _SWITCHED.pop(model, None)
    if before is not None and model.config._attn_implementation in ATTN_NAMES:
        model.set_attn_implementation(before)


class CompressedCache(Cache):
    """A cache of merged slots, one ``CompressedLayer`` per full-attention decoder layer.

    pipeline:        preset name, dict, PipelineConfig or Pipeline (None: no compression, a plain
                     cache served by proportional attention, useful as a reference)
    num_layers:      decoder layers of the model
    vocab:           decoded text of every token id (``token_texts(tokenizer)``) for text-aware chunkers
    backend:         "auto" (SDPA on CUDA, the faster one on CPU), "flex" or "sdpa"
    geometry:        expected KV geometry (set by ``for_model``); a mismatch is a ValueError
    sliding_windows: per layer, None (full attention: compressed) or the window of a sliding
                     layer (kept as transformers' DynamicSlidingWindowLayer)
    record:          a ``Needs`` recorded on top of the pipeline's (e.g. queries for later use)
    overrides:       PipelineConfig fields or "clusterer.tau"-style params applied to ``pipeline``
    """

    def __init__(self, pipeline="semanticache", *, num_layers: int, vocab=None, backend: str = "auto",
                 geometry: ModelGeometry | None = None, sliding_windows: Sequence[int | None] | None = None,
                 record: Needs | None = None, **overrides):
        check_int("num_layers", num_layers, 1)
        require(record is None or isinstance(record, Needs), "record", type(record).__name__, "a Needs or None")
        self.backends = Backends(backend)
        self.pipeline = _as_pipeline(pipeline, overrides)
        self.scheduler = Scheduler(self.pipeline, record)
        self.vocab = None if vocab is None else tuple(vocab)
        self.geometry = geometry
        self.enabled = True  # False: keep appending, never compress
        windows = [None] * num_layers if sliding_windows is None else list(sliding_windows)
        require(len(windows) == num_layers, "sliding_windows", len(windows), f"one entry per layer ({num_layers})")
        needs = self.scheduler.needs
        specs = {ATTN_ACC: ((), torch.float32)} if needs.attention else {}
        layers = [CompressedLayer(i, specs) if w is None else DynamicSlidingWindowLayer(sliding_window=int(w))
                  for i, w in enumerate(windows)]
        require(any(w is None for w in windows), "sliding_windows", windows,
                "at least one full-attention layer")
        super().__init__(layers=layers)
        self._full = tuple(i for i, w in enumerate(windows) if w is None)
        self._ids: Tensor | None = None  # [B, cap] long, ids of all tokens seen (-1 = unknown)
        self._seq_start: Tensor | None = None  # [B] long, leading pad tokens per row
        self._max_left_pad = 0  # the longest left padding of a row (a Python int, for cheap checks)
        self._fwd: _Forward | None = None
        self._fwd_counter = 0
        self._deferred: list[int] = []
        self._chunk_start: int | None = None  # tokens before the prefill chunk in flight (cache.prefill)
        self._chunk_deferred: list[int] = []
        self._next_chunk = 0  # tokens of the prefill chunk after the one in flight (room to leave)
        self.prefill_hooks: list[Callable] = []
        self._bound_to: str | None = None
        self._model = None  # weakref to the bound model
        self._handles: list = []
        self._finalizer = None
        self.stats = {"compress_s": 0.0, "compressions": 0, "prefill_compressions": 0, "decode_compressions": 0}

    # ------------------------------------------------------------------ construction
    @classmethod
    def for_model(cls, model, tokenizer=None, pipeline="semanticache", *, backend: str = "auto", vocab=None,
                  record: Needs | None = None, **overrides) -> "CompressedCache":
        """A cache bound to ``model``: checks the model is supported (a ValueError naming the
        reason otherwise), registers and selects the "kvcompress" attention implementation, and
        installs the hooks that record token ids and padding. ``close()`` (or leaving a ``with``
        block, or garbage collection) removes them and restores the attention implementation.

        tokenizer: gives the decoded text of every token id (built once per tokenizer) for
                   text-aware chunkers; ``vocab`` (a sequence of strings) overrides it
        pipeline:  preset name, dict, PipelineConfig or Pipeline; None = no compression
        overrides: PipelineConfig fields (keep_ratio=0.5, recent=64, ...) for the pipeline
        """
        check_supported(model)
        geometry = ModelGeometry.of(model)
        if vocab is None:
            vocab = token_texts(tokenizer)
        cache = cls(pipeline, num_layers=geometry.num_layers, vocab=vocab, backend=backend, geometry=geometry,
                    sliding_windows=sliding_windows(model), record=record, **overrides)
        if cache.scheduler.needs.model_pass and tokenizer is not None:  # the reconstruction pass at the prefill's end
            from .reconstruct import prefill_hook

            cache.add_prefill_hook(prefill_hook(tokenizer))
        cache.bind(model)
        return cache

    @classmethod
    def from_states(cls, states: Sequence[KVState], pipeline=None, *, vocab=None, backend: str = "auto",
                    geometry: ModelGeometry | None = None, model=None, **overrides) -> "CompressedCache":
        """A cache holding ``states`` (one KVState per layer, the same tokens), as after a prefill.

        Uncompressed states (one slot per token) compress with the prefill rule at the next
        ``compress()``; ``model``: bind the cache to it (for generate). Their "queries" extras
        become the layers' query windows, their stats and other extras are kept.
        """
        states = list(states)
        require(len(states) > 0 and all(isinstance(s, KVState) for s in states), "states",
                type(states).__name__, "a non-empty list of KVState, one per layer")
        first = states[0]
        for s in states:
            s.validate()
            require(s.batch_size == first.batch_size and s.num_tokens == first.num_tokens, "states",
                    f"layers of {first.batch_size}x{first.num_tokens} and {s.batch_size}x{s.num_tokens} tokens",
                    "one state per layer of the same sequence (same batch size and tokens seen)")
        if model is not None and geometry is None:
            geometry = ModelGeometry.of(model)
        cache = cls(pipeline, num_layers=len(states), vocab=first.vocab if vocab is None else vocab,
                    backend=backend, geometry=geometry, **overrides)
        B, T = first.batch_size, first.num_tokens
        ids = torch.full((B, _round_up(T)), -1, dtype=torch.long, device=first.keys.device)
        if first.token_ids is not None:
            ids[:, :T] = first.token_ids[:, :T]
        cache._ids = ids
        cache._seq_start = None if first.seq_start is None else first.seq_start.clone()
        cache._max_left_pad = 0 if first.seq_start is None else int(first.seq_start.max())
        for i, s in enumerate(states):
            cache._install(i, s, None, compressed=not _is_raw(s))
        if model is not None:
            cache.bind(model)
        return cache

    # ------------------------------------------------------------------ binding
    def bind(self, model) -> None:
        """Install the input-recording hooks on ``model`` and select kvcompress attention
        (remembering the implementation it had, which ``close()`` restores)."""
        require(self._bound_to is None, "model", type(model).__name__,
                "a cache not yet bound to a model (call close() first)")
        check_supported(model)
        geometry = ModelGeometry.of(model)
        require(self.geometry is None or self.geometry == geometry, "model", geometry.describe(),
                f"the model this cache was created for ({self.geometry.describe() if self.geometry else ''})")
        require(geometry.num_layers == len(self.layers), "model", geometry.describe(),
                f"a model with {len(self.layers)} layers, as this cache has")
        require(list(sliding_windows(model)) == self._windows(), "model", geometry.describe(),
                "a model with the same sliding-window layers as this cache")
        register_attention()
        before = model.config._attn_implementation
        base = model.base_model
        if before not in ATTN_NAMES:
            _SWITCHED[model] = before
            model.set_attn_implementation(ATTN_AUTO)
        self.geometry = geometry
        ref = weakref.ref(self)

        def pre_hook(module, args, kwargs):
            cache = ref()
            if cache is not None and _cache_arg(args, kwargs) is cache:
                cache._begin_from_model(module, args, kwargs)

        def post_hook(module, args, kwargs, output):
            cache = ref()
            if cache is not None and _cache_arg(args, kwargs) is cache:
                cache._end_from_model(failed=output is None)

        pre_hook._kvcompress_cache_hook = post_hook._kvcompress_cache_hook = True
        self._handles = [base.register_forward_pre_hook(pre_hook, with_kwargs=True),
                         base.register_forward_hook(post_hook, with_kwargs=True, always_call=True)]
        self._model = weakref.ref(model)
        self._finalizer = weakref.finalize(self, _release, list(self._handles), self._model)
        self._bound_to = type(model).__name__

    def close(self) -> None:
        """Remove the hooks installed on the model and restore its attention implementation
        (unless another bound cache still uses it). The cache keeps its contents."""
        if self._finalizer is not None:
            self._finalizer()
        self._handles, self._finalizer, self._bound_to, self._model = [], None, None, None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __deepcopy__(self, memo):
        """An independent cache with the same contents (pipeline, vocabulary and backend shared),
        bound to the same model: a prefilled, compressed document asked many questions."""
        self._flush()
        require(self._fwd is None, "cache", "a forward in flight", "a cache between forwards to copy")
        cls = type(self)
        new = cls.__new__(cls)
        memo[id(self)] = new
        shared = {"pipeline", "scheduler", "vocab", "backends", "geometry"}
        skip = {"_handles", "_finalizer", "_bound_to", "_model"}
        inference = any(t.is_inference() for t in self._tensors())
        with torch.inference_mode(inference):
            for name, value in self.__dict__.items():
                if name in skip:
                    continue
                new.__dict__[name] = value if name in shared else copy.deepcopy(value, memo)
        new._handles, new._finalizer, new._bound_to, new._model = [], None, None, None
        model = None if self._model is None else self._model()
        if model is not None:
            new.bind(model)
        return new

    def _tensors(self):
        for layer in self.layers:
            for t in (getattr(layer, "_k", None), getattr(layer, "keys", None)):
                if isinstance(t, Tensor):
                    yield t
        if self._ids is not None:
            yield self._ids

    # ------------------------------------------------------------------ public API
    @property
    def config(self) -> PipelineConfig | None:
        return None if self.pipeline is None else self.pipeline.config

    @property
    def decoder(self):
        return self.scheduler.decoder

    @property
    def backend(self) -> str:
        return self.backends.backend

    @property
    def num_tokens(self) -> int:
        """Tokens seen (left padding included), as generate counts them."""
        return self.layers[self._full[0]].num_tokens

    @property
    def token_ids(self) -> Tensor | None:
        """[B, T] long: ids of the tokens seen (-1 where unknown)."""
        return None if self._ids is None else self._ids[:, : self.num_tokens]

    @property
    def seq_start(self) -> Tensor | None:
        return self._seq_start

    def compressed_layer_ids(self) -> tuple[int, ...]:
        """Indices of the layers this cache compresses (the full-attention layers)."""
        return self._full

    def layer_state(self, layer_idx: int) -> KVState:
        """Layer ``layer_idx`` as a KVState (views; never written into by pipelines)."""
        require(layer_idx in self._full, "layer_idx", layer_idx, f"a compressed layer, one of {list(self._full)}")
        return self.layers[layer_idx].state(self._ids, self._seq_start, self.vocab)

    def states(self) -> list[KVState | None]:
        """One KVState per layer (None for sliding-window layers, which transformers holds)."""
        self._flush()
        return [self.layer_state(i) if i in self._full and self.layers[i].is_initialized else None
                for i in range(len(self.layers))]

    def compress(self, *, protect: Tensor | None = None) -> None:
        """Compress every layer now: layers not compressed yet by the prefill rule (prefill hooks
        and cross-layer guards first), the others back to their budget. All or nothing.

        protect: [B, T] bool (T = ``num_tokens``) or None; tokens that this compression keeps
                 as they are in every layer and head (e.g. a passage known to matter)
        """
        self._flush()
        require(self._fwd is None, "cache", "a forward in flight", "a cache between forwards")
        require(all(self.layers[i].is_initialized for i in self._full), "cache", "empty layers",
                "a cache that holds tokens (prefill it or build it with from_states)")
        if protect is not None:
            B = self.layers[self._full[0]].keys.shape[0]
            require(isinstance(protect, Tensor) and protect.dtype == torch.bool
                    and tuple(protect.shape) == (B, self.num_tokens), "protect",
                    tuple(getattr(protect, "shape", ())), f"a bool tensor [B, T] = {(B, self.num_tokens)} or None")
        snap = self._snapshot(self._full)
        try:
            self.scheduler.compress_all(self, protect)
        except BaseException:
            self._restore(snap)
            raise

    def prefill(self, input_ids: Tensor, *, chunk: int | None = None) -> None:
        """Run the bound model over ``input_ids`` [B, T] (rows without padding) on top of what the
        cache holds, without logits. chunk: C tokens per forward; the first chunk compresses by
        the prefill rule, every later one right after it (the decode rule, per layer; with
        cross-layer guards at the chunk's end, the guards deciding for the chunk's tokens from
        every layer), so a layer never holds more than its budget of the tokens seen + C slots.
        None: one forward (the whole prompt uncompressed until the prefill rule runs)."""
        require(isinstance(input_ids, Tensor) and input_ids.dim() == 2 and input_ids.shape[1] >= 1
                and not input_ids.is_floating_point(), "input_ids", tuple(getattr(input_ids, "shape", ())),
                "a [B, T] tensor of token ids with T >= 1")
        if chunk is not None:
            check_int("chunk", chunk, 1)
        model = None if self._model is None else self._model()
        require(model is not None, "cache", "not bound to a model",
                "a cache bound to a model (CompressedCache.for_model or bind(model))")
        base = model.base_model
        key = "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"
        T = input_ids.shape[1]
        step = T if chunk is None else chunk
        with torch.inference_mode():
            for a in range(0, T, step):
                ids = input_ids[:, a: a + step]
                seen = self.num_tokens if any(self.layers[i].is_initialized for i in self._full) else 0
                first = seen == 0
                self._chunk_start = None if first else seen
                self._next_chunk = min(step, T - a - step) if chunk is not None else 0
                try:
                    mask = torch.ones(ids.shape[0], seen + ids.shape[1], dtype=torch.long, device=ids.device)
                    base(input_ids=ids, attention_mask=mask, use_cache=True, **{key: self})
                finally:
                    self._chunk_start, self._next_chunk = None, 0

    def add_prefill_hook(self, fn: Callable) -> None:
        """Run ``fn(cache, model)`` at every prefill's end, before the compression (``model`` is
        the bound model or None); it may write ``set_stats`` / ``set_extras``. Its own forwards
        must use another cache. With a hook, every layer's prefill compression waits for it."""
        require(callable(fn), "fn", fn, "a callable fn(cache, model)")
        self.prefill_hooks.append(fn)

    def set_stats(self, name: str, values: Sequence[Tensor | None]) -> None:
        """Per-slot statistics, one tensor [B, H, N_layer, ...] per layer (None for a layer to
        leave alone): summed by mergers, zero for tokens appended later."""
        values = list(values)
        require(len(values) == len(self.layers), "values", len(values), f"one entry per layer ({len(self.layers)})")
        for i, value in enumerate(values):
            if value is not None:
                require(i in self._full, f"values[{i}]", "a tensor", "None for a sliding-window layer")
                self.layers[i].set_stat(name, value)

    def drop_stats(self, name: str) -> None:
        """Remove the per-slot statistic ``name`` from every layer (nothing when absent)."""
        for i in self._full:
            self.layers[i].drop_stat(name)

    def set_extras(self, name: str, values: Sequence) -> None:
        """Carried data, one value per layer (None: leave the layer alone), in each state's extras."""
        values = list(values)
        require(len(values) == len(self.layers), "values", len(values), f"one entry per layer ({len(self.layers)})")
        for i, value in enumerate(values):
            if value is not None and i in self._full:
                self.layers[i].extras[name] = value

    def request_for(self, keys: Tensor) -> AttentionRequest | None:
        """The pending attention request whose keys are ``keys`` (the tensor ``update`` returned)."""
        fwd = self._fwd
        if fwd is None:
            return None
        for request, _ in fwd.requests.values():
            if request.keys is keys and not request.done:
                return request
        return None

    # ------------------------------------------------------------------ sizes
    def slots_per_layer(self) -> list[int]:
        """Slot count of each compressed layer's tensors (padding slots of shorter heads included)."""
        return [self.layers[i].n for i in self._full]

    def valid_slots_per_layer(self) -> list[float]:
        """Mean number of slots holding tokens per (row, head), per compressed layer."""
        return [float(self.layers[i].valid_slots().float().mean()) if self.layers[i].is_initialized else 0.0
                for i in self._full]

    def budget_scale_per_layer(self) -> list[float]:
        """Each compressed layer's share of the budget relative to an even split (1.0 unless a
        cross-layer guard split it, ``kvcompress.budget.LAYER_SCALE``; the smallest row's)."""
        shares = [self.layers[i].budget_share() for i in self._full]
        return [1.0 if share is None else round(share, 6) for share in shares]

    def kv_bytes(self) -> int:
        """Bytes of keys, values and log-sizes of the slots in use (sliding layers: their window)."""
        return sum(self.layers[i].nbytes() for i in self._full) + self._sliding_bytes()

    def allocated_bytes(self) -> int:
        """Bytes of all buffers, spare capacity and bookkeeping included."""
        return sum(self.layers[i].allocated_bytes() for i in self._full) + self._sliding_bytes()

    def full_kv_bytes(self) -> int:
        """Bytes a stock cache would hold for the tokens seen (sliding layers: their window)."""
        return sum(self.layers[i].full_bytes() for i in self._full) + self._sliding_bytes()

    def _sliding_bytes(self) -> int:
        total = 0
        for i, layer in enumerate(self.layers):
            if i not in self._full and layer.keys is not None:
                total += sum(t.numel() * t.element_size() for t in (layer.keys, layer.values))
        return total

    def report(self) -> dict:
        """Sizes, slots, compression counts and times, as plain Python values."""
        self._flush()
        return {
            "pipeline": None if self.config is None else self.config.name,
            "tokens_seen": self.num_tokens,
            "kv_bytes_full": self.full_kv_bytes(),
            "kv_bytes_compressed": self.kv_bytes(),
            "kv_bytes_allocated": self.allocated_bytes(),
            "slots_per_layer": self.slots_per_layer(),
            "valid_slots_per_layer": [round(x, 2) for x in self.valid_slots_per_layer()],
            "budget_scale_per_layer": self.budget_scale_per_layer(),
            "compressed_layers": list(self._full),
            "compress_s": self.stats["compress_s"],
            "compressions": self.stats["compressions"],
            "compiles": compile_count(),
        }

    # ------------------------------------------------------------------ Cache overrides
    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        """Append q new tokens to layer ``layer_idx``; return the keys/values attention reads.

        key_states, value_states: [B, H, q, D], keys already rotated (RoPE)
        kwargs["kwargs"]:         the attention module's kwargs dict (Llama family): the
                                  AttentionRequest is put into it; other models' attention finds
                                  it by the returned keys while a bound forward runs
        """
        B, H, q, D = key_states.shape
        try:
            self._check_states(layer_idx, key_states, value_states)
            fwd = self._forward_for_layer(layer_idx, B, q, key_states.device)
            self._settle(fwd)  # the layers attended before this one: record, maybe compress
        except BaseException:
            self._rollback_forward()  # the layers already updated in this forward go back too
            raise
        layer = self.layers[layer_idx]
        if layer_idx not in self._full:
            fwd.snapshot.layers.setdefault(layer_idx, dict(layer.__dict__))
            return layer.update(key_states, value_states, *args, **kwargs)
        fwd.snapshot.layers.setdefault(layer_idx, layer.snapshot())
        fresh = layer.n == 0 and layer.num_tokens == 0
        compressed_before = layer.compressed
        layer.append(key_states, value_states, fwd.pad, spare=BUCKET if self.pipeline is None else 0)
        keys, values, log_sizes = layer.attention_view(q, fresh)
        needs = self.scheduler.needs
        cfg = self.config
        request = AttentionRequest(
            keys=keys, log_sizes=log_sizes, fresh=fresh, compressed=compressed_before, causal=q > 1,
            use_sizes=cfg.proportional_attention if cfg is not None else True, attend=self.backends,
            query_window=needs.query_window, reference_queries=needs.reference_queries if fresh else 0,
            track_attention=needs.attention, query_valid=None if fwd.pad is None else ~fwd.pad,
            seq_start=self._seq_start,
        )
        fwd.requests[layer_idx] = (request, fresh)
        attn_kwargs = kwargs.get("kwargs")
        if isinstance(attn_kwargs, dict):
            attn_kwargs[REQUEST_KEY] = request
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].get_seq_length() if layer_idx < len(self.layers) else 0

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()
        self._ids, self._seq_start, self._fwd, self._deferred = None, None, None, []
        self._chunk_deferred, self._chunk_start = [], None
        self._max_left_pad = 0

    def crop(self, tokens_to_remove: int) -> None:
        for layer in self.layers:
            layer.crop(tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._batch_apply(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._batch_apply(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: Tensor) -> None:
        self._batch_apply(lambda t: t[indices.to(t.device) if isinstance(indices, Tensor) else indices])

    def _batch_apply(self, fn) -> None:
        self._close_forward(raise_errors=True)
        for i, layer in enumerate(self.layers):
            if i in self._full:
                layer.batch_apply(fn)
            elif layer.keys is not None:
                layer.keys, layer.values = fn(layer.keys), fn(layer.values)
        if self._ids is not None:
            self._ids = fn(self._ids)
        if self._seq_start is not None:
            self._seq_start = fn(self._seq_start)

    # ------------------------------------------------------------------ inputs of a forward
    def set_inputs(self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None) -> None:
        """Declare the inputs of the next forward by hand (for a cache not bound to a model).

        input_ids: [B, q] long or None; attention_mask: [B, T + q] (1 = token, 0 = padding) or None
        """
        require(self._bound_to is None, "set_inputs", self._bound_to,
                "a cache not bound to a model (a bound cache records inputs itself)")
        require(input_ids is not None, "input_ids", None, "a [B, q] tensor of token ids")
        B, q = input_ids.shape
        self._begin_forward(input_ids, attention_mask, B, q, input_ids.device)

    def _begin_from_model(self, module, args, kwargs) -> None:
        fwd = self._fwd
        require(fwd is None or not fwd.ending, "model forward", "a forward with this cache inside its prefill hook",
                "prefill hooks that run the model with another cache")
        impl = module.config._attn_implementation
        require(impl in ATTN_NAMES, "attn_implementation", impl,
                f"one of {list(ATTN_NAMES)} for a CompressedCache (model.set_attn_implementation('kvcompress'))")
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        attention_mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        embeds = kwargs.get("inputs_embeds")
        ref = input_ids if input_ids is not None else embeds
        require(ref is not None, "input_ids", None, "input_ids or inputs_embeds")
        B, q = ref.shape[0], ref.shape[1]
        layer0 = self.layers[self._full[0]]
        if layer0.is_initialized:
            dtype = getattr(module, "dtype", layer0._k.dtype)
            require(dtype == layer0._k.dtype, "model.dtype", dtype,
                    f"{layer0._k.dtype}, the dtype of the cached states (a cache cannot change dtype)")
            require(ref.device == layer0._k.device, "input device", str(ref.device),
                    f"{layer0._k.device}, the device of the cached states")
        self._begin_forward(input_ids, attention_mask, B, q, ref.device)
        self._fwd.token = ACTIVE_CACHE.set(self)

    def _end_from_model(self, failed: bool) -> None:
        fwd = self._fwd
        if fwd is None:
            return
        if fwd.token is not None:
            ACTIVE_CACHE.reset(fwd.token)
            fwd.token = None
        if failed:
            self._rollback_forward()  # the forward raised: its error propagates, the cache is as before
            return
        self._close_forward(raise_errors=True)

    def _begin_forward(self, input_ids, attention_mask, B: int, q: int, device) -> None:
        self._close_forward(raise_errors=False)
        T = self.num_tokens
        if self._ids is not None:
            require(B == self._ids.shape[0], "batch size", B,
                    f"{self._ids.shape[0]}, the batch of the cached states (reset() the cache for a new batch)")
        if input_ids is not None:
            require(input_ids.dim() == 2 and tuple(input_ids.shape) == (B, q), "input_ids", tuple(input_ids.shape),
                    f"a [B, q] tensor of shape {(B, q)}")
        pad = None
        if attention_mask is not None:
            require(isinstance(attention_mask, Tensor) and attention_mask.dim() == 2
                    and tuple(attention_mask.shape) == (B, T + q), "attention_mask",
                    tuple(getattr(attention_mask, "shape", ())),
                    f"a 2-d mask of shape {(B, T + q)} (tokens seen + new tokens; 4-d masks are not supported)")
            pad = ~attention_mask[:, T:].to(device=device, dtype=torch.bool)
            if not bool(pad.any()):
                pad = None
        snap = CacheSnapshot(self._ids, self._seq_start, self._max_left_pad, stats=dict(self.stats))
        if self._ids is None:
            self._ids = torch.full((B, _round_up(q)), -1, dtype=torch.long, device=device)
        elif T + q > self._ids.shape[1]:
            grown = torch.full((B, _round_up(max(T + q, self._ids.shape[1] * 3 // 2))), -1,
                               dtype=torch.long, device=device)
            grown[:, :T] = self._ids[:, :T]
            self._ids = grown
        self._ids[:, T: T + q] = -1 if input_ids is None else input_ids.to(device=device, dtype=torch.long)
        if T == 0:
            self._seq_start = None if pad is None else pad.long().cumprod(dim=1).sum(dim=1)
            self._max_left_pad = 0 if self._seq_start is None else int(self._seq_start.max())
        self._fwd_counter += 1
        self._fwd = _Forward(self._fwd_counter, q, B, pad, snap)

    def _forward_for_layer(self, layer_idx: int, B: int, q: int, device) -> _Forward:
        fwd = self._fwd
        if fwd is None or layer_idx in fwd.done:
            if self._bound_to is not None:
                raise ValueError(
                    f"layer {layer_idx} was updated outside a forward of the model this cache was created for "
                    f"({self._bound_to}): a bound CompressedCache cannot be reused with another model; create "
                    "one per model with CompressedCache.for_model (or copy.deepcopy it)")
            self._begin_forward(None, None, B, q, device)
            fwd = self._fwd
        require(fwd.q == q and fwd.batch == B, "key_states", (B, q),
                f"batch {fwd.batch} and {fwd.q} new tokens, as in this forward's inputs "
                "(a cache cannot be shared between models)")
        fwd.done.add(layer_idx)
        return fwd

    def _check_states(self, layer_idx: int, key_states: Tensor, value_states: Tensor) -> None:
        require(0 <= layer_idx < len(self.layers), "layer_idx", layer_idx, f"a layer index < {len(self.layers)}")
        require(key_states.dim() == 4 and value_states.dim() == 4 and key_states.shape[:3] == value_states.shape[:3],
                "key_states/value_states", (tuple(key_states.shape), tuple(value_states.shape)),
                "[B, H, q, D] tensors with the same B, H, q")
        geo = self.geometry
        B, H, q, D = key_states.shape
        if geo is not None:
            require(H == geo.num_kv_heads and D == geo.head_dim, "key_states", tuple(key_states.shape),
                    f"H={geo.num_kv_heads} KV heads and head_dim {geo.head_dim}: this cache was created for "
                    f"{geo.describe()}; it cannot be reused with another model")
        layer = self.layers[layer_idx]
        if layer_idx in self._full and layer._k is not None:
            b0, h0, _, d0 = layer._k.shape
            require((B, H, D) == (b0, h0, d0), "key_states", tuple(key_states.shape),
                    f"batch {b0}, {h0} heads, head_dim {d0} as in the states already cached in layer "
                    f"{layer_idx} (a cache cannot be reused with another model or batch)")
            require(key_states.dtype == layer._k.dtype and value_states.dtype == layer._v.dtype,
                    "key_states.dtype", key_states.dtype, f"{layer._k.dtype}, the dtype of the cached states")
            require(key_states.device == layer._k.device, "key_states.device", str(key_states.device),
                    f"{layer._k.device}, the device of the cached states")
        require(key_states.is_floating_point(), "key_states.dtype", key_states.dtype, "a floating-point dtype")

    # ------------------------------------------------------------------ the scheduler's side
    def _settle(self, fwd: _Forward) -> None:
        """Take in what the attention recorded for the layers attended so far, and let the
        scheduler compress them."""
        for layer_idx in sorted(fwd.requests):
            request, fresh = fwd.requests.pop(layer_idx)
            if not request.done:
                raise ValueError("attn_implementation is invalid: expected a kvcompress attention function "
                                 f"({list(ATTN_NAMES)}) to serve a CompressedCache (layer {layer_idx} was not "
                                 "attended by it); the forward was undone")
            layer = self.layers[layer_idx]
            if request.queries is not None:
                layer.keep_queries(request.queries, request.query_window)
            if request.reference is not None:
                layer.extras[REFERENCE_QUERIES] = request.reference
            if request.received is not None:
                layer.add_stat(ATTN_ACC, request.received)
            self.scheduler.after_attention(self, layer_idx, fresh)

    def _flush(self) -> None:
        """Finish a forward whose layers have all been updated (an unbound cache learns of a
        forward's end only when it is next used)."""
        fwd = self._fwd
        if fwd is not None and not fwd.ending and len(fwd.done) == len(self.layers) and fwd.token is None:
            self._close_forward(raise_errors=True)

    def _close_forward(self, raise_errors: bool) -> None:
        """Commit the forward in flight if every layer was updated and attended, else undo it."""
        fwd = self._fwd
        if fwd is None:
            return
        complete = len(fwd.done) == len(self.layers)
        if not complete:
            self._rollback_forward()
            if raise_errors:
                raise ValueError(f"model is invalid: expected a model with {len(self.layers)} attention layers as "
                                 f"this cache, but the forward updated {len(fwd.done)}; the forward was undone")
            return
        try:
            self._settle(fwd)
            deferred, self._deferred = self._deferred, []
            if deferred:
                fwd.ending = True
                self._run_prefill_hooks()
                self.scheduler.compress_prefill(self, deferred)
            chunked, self._chunk_deferred = self._chunk_deferred, []
            if chunked:
                fwd.ending = True
                self.scheduler.compress_chunk(self, chunked, self._chunk_start)
        except BaseException:
            self._rollback_forward()  # a complete forward that failed: always an error
            raise
        self._fwd = None

    def _run_prefill_hooks(self) -> None:
        model = None if self._model is None else self._model()
        for fn in self.prefill_hooks:
            fn(self, model)

    def _rollback_forward(self) -> None:
        """Undo the forward in flight: the cache is as before it."""
        fwd, self._fwd = self._fwd, None
        self._deferred, self._chunk_deferred = [], []
        if fwd is None:
            return
        if fwd.token is not None:
            ACTIVE_CACHE.reset(fwd.token)
        self._restore(fwd.snapshot)

    def _snapshot(self, layer_ids) -> CacheSnapshot:
        layers = {i: self.layers[i].snapshot() for i in layer_ids}
        return CacheSnapshot(self._ids, self._seq_start, self._max_left_pad, layers, stats=dict(self.stats))

    def _restore(self, snap: CacheSnapshot) -> None:
        for i, saved in snap.layers.items():
            layer = self.layers[i]
            if isinstance(saved, LayerSnapshot):
                layer.restore(saved)
            else:
                layer.__dict__.clear()
                layer.__dict__.update(saved)
        self._ids, self._seq_start, self._max_left_pad = snap.ids, snap.seq_start, snap.max_left_pad
        self.stats = dict(snap.stats)

    def _install(self, layer_idx: int, state: KVState, report, compressed: bool = True) -> None:
        layer = self.layers[layer_idx]
        # while a chunked prefill runs, room for the next chunk: it is appended in place (no
        # second copy of the layer while the forward's rollback snapshot holds the first)
        layer.install(state, max(self.scheduler.headroom, self._next_chunk))
        layer.compressed = compressed
        layer.last_report = report
        if layer._k.device.type == "cuda":
            torch.cuda.synchronize(layer._k.device)  # kernels are asynchronous: time them whole

    def _record_compression(self, seconds: float, prefill: bool) -> None:
        self.stats["compress_s"] += seconds
        self.stats["compressions"] += 1
        self.stats["prefill_compressions" if prefill else "decode_compressions"] += 1

    def _windows(self) -> list[int | None]:
        return [None if i in self._full else int(layer.sliding_window) for i, layer in enumerate(self.layers)]


def _is_raw(state: KVState) -> bool:
    """True when every slot is one token in order (nothing merged or dropped)."""
    if state.num_slots != state.num_tokens:
        return False
    valid = state.valid
    expected = torch.arange(state.num_tokens, device=state.positions.device).expand_as(state.positions)
    return bool(((state.positions == expected) | ~valid).all()) and bool((state.log_sizes[valid] == 0).all())


def _cache_arg(args, kwargs):
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if cache is None and len(args) > 3:
        cache = args[3]  # LlamaModel.forward(input_ids, attention_mask, position_ids, cache, ...)
    return cache


__all__ = ["CompressedCache", "CompressedLayer", "CacheSnapshot", "BUCKET"]
