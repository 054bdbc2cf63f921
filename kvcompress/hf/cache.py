"""CompressedCache: a transformers ``Cache`` whose layers hold merged slots with log-sizes.

    cache = CompressedCache.for_model(model, tokenizer, "semanticache", keep_ratio=0.5)
    out = model.generate(**inputs, cache=cache, max_new_tokens=64)  # past_key_values= before the rename
    cache.close()  # or let it be garbage-collected: removes the hooks it installed

``for_model`` registers the kvcompress attention implementations, switches the model to
"kvcompress" (which behaves exactly like "sdpa" for any other cache), and installs a forward
pre-hook and hook on the model's base model. The hooks record, for every forward that uses
this cache, the token ids (text-aware chunkers need them) and which new tokens are left padding
(those get log-size -inf and can never be attended, even after merging).

Compression: each layer compresses itself right after its attention output is computed in the
forward that fills it (the prefill), so ``model.generate(..., cache=cache)`` works
directly and the first generated token still sees the full prompt. While decoding,
``DecodeCompressor`` compresses a layer back to the budget when it exceeds it by
``recompress_every`` slots. A cache that already covers the whole prompt makes generate re-feed
the prompt: prefill all but the last token yourself, or let generate prefill.

``get_seq_length()`` is the number of TOKENS SEEN, not slots: generate and the model derive
positions from it. A forward that fails (e.g. a budget that cannot be met) leaves the cache as
it was before that forward.

Beam search: let generate prefill (it expands the prompt, the cache follows), or call
``cache.batch_repeat_interleave(num_beams)`` on a cache you prefilled yourself.
Statistics for scorers: with ``query_window=W`` each layer's state carries its last W post-RoPE
queries in ``extras["queries"]`` [B, H_q, W, D]; with ``track_attention=True`` the attention each
slot received (prefill and decoding, summed over the query heads of its KV group) in
``extras["attn_acc"]`` [B, H_kv, N] float32, summed over members when slots merge.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Mapping

import torch
from torch import Tensor
from transformers.cache_utils import Cache

from ..config import PipelineConfig, as_config
from ..decode import DecodeCompressor
from ..pipeline import Pipeline
from ..validation import check_choice, check_int, require
from .attention import BACKENDS, compile_count, register_attention
from .layer import BUCKET, CompressedLayer, _round_up
from .support import ATTN_AUTO, ATTN_NAMES, ModelGeometry, check_supported
from .vocab import token_texts


@dataclass
class _Forward:
    index: int
    q: int
    batch: int
    pad: Tensor | None  # [B, q] bool, True = padding token
    implicit: bool
    undo: tuple
    done: set = field(default_factory=set)


def _as_pipeline(pipeline, overrides) -> Pipeline | None:
    if pipeline is None:
        require(not overrides, "overrides", sorted(overrides), "none when pipeline=None (no compression)")
        return None
    if isinstance(pipeline, Pipeline):
        return Pipeline(pipeline.config, **overrides) if overrides else pipeline
    require(isinstance(pipeline, (str, Mapping, PipelineConfig)), "pipeline", pipeline,
            "a preset name, a dict, a PipelineConfig, a Pipeline or None")
    return Pipeline(as_config(pipeline, **overrides))


class CompressedCache(Cache):
    """A cache of merged slots, one ``CompressedLayer`` per decoder layer.

    pipeline:   preset name, dict, PipelineConfig or Pipeline (None: no compression, a plain cache
                served by proportional attention, useful as a reference)
    num_layers: decoder layers of the model
    vocab:      decoded text of every token id (``token_texts(tokenizer)``) for text-aware chunkers
    backend:    "auto" (FlexAttention on CUDA, the faster one on CPU), "flex" or "sdpa"
    geometry:   expected KV geometry (set by ``for_model``); a mismatch is a ValueError
    overrides:  PipelineConfig fields or "clusterer.tau"-style params applied to ``pipeline``
    """

    def __init__(self, pipeline="semanticache", *, num_layers: int, vocab=None, backend: str = "auto",
                 geometry: ModelGeometry | None = None, **overrides):
        check_int("num_layers", num_layers, 1)
        check_choice("backend", backend, BACKENDS)
        self.pipeline = _as_pipeline(pipeline, overrides)
        self.decoder = None if self.pipeline is None else DecodeCompressor(self.pipeline)
        self.backend = backend
        self.vocab = None if vocab is None else tuple(vocab)
        self.geometry = geometry
        self.enabled = True  # False: keep appending, never compress
        super().__init__(layers=[CompressedLayer(self, i) for i in range(num_layers)])
        self._ids: Tensor | None = None  # [B, cap] long, ids of all tokens seen (-1 = unknown)
        self._seq_start: Tensor | None = None  # [B] long, leading pad tokens per row
        self._num_tokens = 0
        self._max_left_pad = 0  # the longest left padding of a row (a Python int, for cheap checks)
        self._fwd: _Forward | None = None
        self._fwd_counter = 0
        self._bound_to: str | None = None
        self._handles: list = []
        self._finalizer = None
        self.stats = {"compress_s": 0.0, "compressions": 0, "prefill_compressions": 0, "decode_compressions": 0}

    # ------------------------------------------------------------------ construction for a model
    @classmethod
    def for_model(cls, model, tokenizer=None, pipeline="semanticache", *, backend: str = "auto", vocab=None,
                  **overrides) -> "CompressedCache":
        """A cache bound to ``model``: checks the model is supported, registers and selects the
        "kvcompress" attention implementation, and installs the hooks that record token ids and
        padding. The hooks are removed by ``close()`` or when the cache is garbage-collected.

        tokenizer: gives the decoded text of every token id (built once per tokenizer) for
                   text-aware chunkers; ``vocab`` (a sequence of strings) overrides it
        pipeline:  preset name, dict, PipelineConfig or Pipeline; None = no compression
        overrides: PipelineConfig fields (keep_ratio=0.5, recent=64, ...) for the pipeline
        """
        check_supported(model)
        geometry = ModelGeometry.of(model)
        if vocab is None:
            vocab = token_texts(tokenizer)
        cache = cls(pipeline, num_layers=geometry.num_layers, vocab=vocab, backend=backend,
                    geometry=geometry, **overrides)
        cache.bind(model)
        return cache

    def bind(self, model) -> None:
        """Install the input-recording hooks on ``model`` and select kvcompress attention."""
        require(self._bound_to is None, "model", type(model).__name__,
                "a cache not yet bound to a model (call close() first)")
        check_supported(model)
        geometry = ModelGeometry.of(model)
        require(self.geometry is None or self.geometry == geometry, "model", geometry.describe(),
                f"the model this cache was created for ({self.geometry.describe() if self.geometry else ''})")
        require(geometry.num_layers == len(self.layers), "model", geometry.describe(),
                f"a model with {len(self.layers)} layers, as this cache has")
        register_attention()
        if model.config._attn_implementation not in ATTN_NAMES:
            model.set_attn_implementation(ATTN_AUTO)
        self.geometry = geometry
        base = model.base_model
        ref = weakref.ref(self)

        def pre_hook(module, args, kwargs):
            cache = ref()
            if cache is not None and _cache_arg(args, kwargs) is cache:
                cache._begin_from_model(module, args, kwargs)

        def post_hook(module, args, kwargs, output):
            cache = ref()
            if cache is not None and _cache_arg(args, kwargs) is cache:
                cache._close_forward(raise_errors=True)

        self._handles = [base.register_forward_pre_hook(pre_hook, with_kwargs=True),
                         base.register_forward_hook(post_hook, with_kwargs=True)]
        self._finalizer = weakref.finalize(self, _remove_handles, list(self._handles))
        self._bound_to = type(model).__name__

    def close(self) -> None:
        """Remove the hooks installed on the model (the cache keeps its contents)."""
        if self._finalizer is not None:
            self._finalizer()
        self._handles, self._finalizer, self._bound_to = [], None, None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ properties
    @property
    def config(self) -> PipelineConfig | None:
        return None if self.pipeline is None else self.pipeline.config

    @property
    def num_tokens(self) -> int:
        """Tokens seen (left padding included), as generate counts them."""
        return self.layers[0].num_tokens

    @property
    def token_ids(self) -> Tensor | None:
        """[B, T] long: ids of the tokens seen (-1 where unknown)."""
        return None if self._ids is None else self._ids[:, : self.num_tokens]

    @property
    def seq_start(self) -> Tensor | None:
        return self._seq_start

    def slots_per_layer(self) -> list[int]:
        """Slot count of each layer's tensors (padding slots of shorter heads included)."""
        return [layer.n for layer in self.layers]

    def valid_slots_per_layer(self) -> list[float]:
        """Mean number of slots holding tokens per (row, head), per layer."""
        return [float(layer.valid_slots().float().mean()) if layer.is_initialized else 0.0 for layer in self.layers]

    def kv_bytes(self) -> int:
        """Bytes of keys, values and log-sizes of the slots in use, all layers."""
        return sum(layer.nbytes() for layer in self.layers)

    def allocated_bytes(self) -> int:
        """Bytes of all buffers, spare capacity and bookkeeping included."""
        return sum(layer.allocated_bytes() for layer in self.layers)

    def full_kv_bytes(self) -> int:
        """Bytes a stock (uncompressed) cache would hold for the tokens seen."""
        total = 0
        for layer in self.layers:
            if layer.is_initialized:
                B, H, _, D = layer._k.shape
                total += B * H * layer.num_tokens * D * (layer._k.element_size() + layer._v.element_size())
        return total

    def report(self) -> dict:
        """Sizes, slots, compression counts and times, as plain Python values."""
        return {
            "pipeline": None if self.config is None else self.config.name,
            "tokens_seen": self.num_tokens,
            "kv_bytes_full": self.full_kv_bytes(),
            "kv_bytes_compressed": self.kv_bytes(),
            "kv_bytes_allocated": self.allocated_bytes(),
            "slots_per_layer": self.slots_per_layer(),
            "valid_slots_per_layer": [round(x, 2) for x in self.valid_slots_per_layer()],
            "compress_s": self.stats["compress_s"],
            "compressions": self.stats["compressions"],
            "compiles": compile_count(),
        }

    # ------------------------------------------------------------------ Cache overrides
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].get_seq_length() if layer_idx < len(self.layers) else 0

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()
        self._ids, self._seq_start, self._num_tokens, self._fwd = None, None, 0, None
        self._max_left_pad = 0

    def crop(self, tokens_to_remove: int) -> None:
        for layer in self.layers:
            layer.crop(tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._close_forward(raise_errors=True)
        super().reorder_cache(beam_idx)
        self._batch_apply(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._close_forward(raise_errors=True)
        super().batch_repeat_interleave(repeats)
        self._batch_apply(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: Tensor) -> None:
        self._close_forward(raise_errors=True)
        super().batch_select_indices(indices)
        self._batch_apply(lambda t: t[indices.to(t.device) if isinstance(indices, Tensor) else indices])

    def _batch_apply(self, fn) -> None:
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
        self._begin_forward(input_ids, attention_mask, B, q, input_ids.device, implicit=False)

    def _begin_from_model(self, module, args, kwargs) -> None:
        impl = module.config._attn_implementation
        require(impl in ATTN_NAMES, "attn_implementation", impl,
                f"one of {list(ATTN_NAMES)} for a CompressedCache (model.set_attn_implementation('kvcompress'))")
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        attention_mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        embeds = kwargs.get("inputs_embeds")
        ref = input_ids if input_ids is not None else embeds
        require(ref is not None, "input_ids", None, "input_ids or inputs_embeds")
        B, q = ref.shape[0], ref.shape[1]
        layer0 = self.layers[0]
        if layer0.is_initialized:
            dtype = getattr(module, "dtype", layer0._k.dtype)
            require(dtype == layer0._k.dtype, "model.dtype", dtype,
                    f"{layer0._k.dtype}, the dtype of the cached states (a cache cannot change dtype)")
            require(ref.device == layer0._k.device, "input device", str(ref.device),
                    f"{layer0._k.device}, the device of the cached states")
        self._begin_forward(input_ids, attention_mask, B, q, ref.device, implicit=False)

    def _begin_forward(self, input_ids, attention_mask, B: int, q: int, device, implicit: bool) -> None:
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
        undo = (self._ids, self._seq_start, self._num_tokens, self._max_left_pad)
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
        self._num_tokens = T + q
        self._fwd_counter += 1
        self._fwd = _Forward(self._fwd_counter, q, B, pad, implicit, undo)

    def _forward_for_layer(self, layer_idx: int, B: int, q: int, device) -> _Forward:
        fwd = self._fwd
        if fwd is None or layer_idx in fwd.done:
            if self._bound_to is not None:
                raise ValueError(
                    f"layer {layer_idx} was updated outside a forward of the model this cache was created for "
                    f"({self._bound_to}): a bound CompressedCache cannot be reused with another model; create "
                    "one per model with CompressedCache.for_model")
            self._begin_forward(None, None, B, q, device, implicit=True)
            fwd = self._fwd
        require(fwd.q == q and fwd.batch == B, "key_states", (B, q),
                f"batch {fwd.batch} and {fwd.q} new tokens, as in this forward's inputs "
                "(a cache cannot be shared between models)")
        fwd.done.add(layer_idx)
        return fwd

    def _close_forward(self, raise_errors: bool) -> None:
        """Commit the forward in flight if every layer ran kvcompress attention, else undo it."""
        fwd = self._fwd
        if fwd is None:
            return
        self._fwd = None
        complete = len(fwd.done) == len(self.layers)
        attended = all(layer._step is None or layer._step.done for layer in self.layers)
        if complete and attended:
            for layer in self.layers:
                layer._commit()
            return
        self._undo_forward(fwd)
        if not attended and (raise_errors or complete):
            raise ValueError("attn_implementation is invalid: expected a kvcompress attention function "
                             f"({list(ATTN_NAMES)}) to serve a CompressedCache; the forward was undone")
        if not complete and raise_errors:
            raise ValueError(f"model is invalid: expected a model with {len(self.layers)} attention layers as this "
                             f"cache, but the forward updated {len(fwd.done)}; the forward was undone")

    def _undo_forward(self, fwd: _Forward) -> None:
        for layer in self.layers:
            layer._rollback()
        self._ids, self._seq_start, self._num_tokens, self._max_left_pad = fwd.undo

    def _rollback_forward(self) -> None:
        """Undo the forward in flight (a compression failed): the cache is as before it."""
        fwd, self._fwd = self._fwd, None
        if fwd is not None:
            self._undo_forward(fwd)

    def _record_compression(self, seconds: float, prefill: bool) -> None:
        self.stats["compress_s"] += seconds
        self.stats["compressions"] += 1
        self.stats["prefill_compressions" if prefill else "decode_compressions"] += 1


def _cache_arg(args, kwargs):
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if cache is None and len(args) > 3:
        cache = args[3]  # LlamaModel.forward(input_ids, attention_mask, position_ids, cache, ...)
    return cache


def _remove_handles(handles) -> None:
    for handle in handles:
        handle.remove()


__all__ = ["CompressedCache", "CompressedLayer", "BUCKET"]
