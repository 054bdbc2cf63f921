"""The caches a benchmark decodes with, all built from one prefill (a ``Snapshot``).

- ``stock_cache``: transformers' own ``DynamicCache`` (stock SDPA attention): the baseline a
  user has without kvcompress. It grows by ``torch.cat`` every step.
- ``uncompressed_cache``: a ``CompressedCache`` without a pipeline: the same preallocated
  buffers and proportional-attention kernels as the compressed caches, nothing merged.
- ``compressed_cache``: a copy compressed by a pipeline exactly as in a real prefill
  (``kvcompress.eval.caches.compressed_copy``). A pipeline that needs a model pass before it
  compresses (``needs.model_pass``: the question-free importance presets read the reconstruction
  statistic) gets it as ``CompressedCache.for_model`` would register it: the reconstruction
  pass as a prefill hook of a cache bound to the model, run by ``cache.compress()`` before the
  pipeline; its time is reported apart (``Built.reconstruct_s``), not as compression.
- ``clone_cache``: an independent copy of a built cache (another backend decodes from the same
  compressed state without compressing twice).
- ``random_snapshot``: a snapshot of random keys/values over real token ids, for models whose
  prefill is too slow to run (the synthetic Llama-3-8B stack at 32k tokens).
"""

from __future__ import annotations

import copy
import dataclasses
import time

import torch
from torch import Tensor

from ..eval.caches import Recorder, Snapshot, as_needed, compressed_copy, keep_reached, recording_needs
from ..types import KVState
from ..validation import require


def prefill_snapshot(model, tokenizer, vocab, ids: Tensor, configs, backend: str = "sdpa") -> tuple[Snapshot, float]:
    """One model prefill of ``ids`` [1, T] into an uncompressed cache; (snapshot, seconds).

    The recorder keeps what the configs' strategies need (``Needs``: query window, strided
    reference queries, attention statistics).
    """
    rec = Recorder(model, tokenizer, backend=backend, vocab=vocab, needs=recording_needs(configs))
    try:
        rec.feed(ids)
        snap = rec.snapshot()
    finally:
        rec.close()
    return snap, rec.prefill_s


def random_snapshot(model, token_ids: Tensor, vocab, *, seed: int = 0, query_window: int = 0,
                    prototypes: int = 64) -> Snapshot:
    """Per-layer states of random keys/values [1, H_kv, T, D] in the model's dtype.

    Keys lie around ``prototypes`` random directions per head (plus noise), so similarity-based
    methods find structure to merge, as in real caches; values are Gaussian.
    token_ids: [1, T] long (real text ids: text-aware chunkers see real delimiters)
    query_window: also store that many random queries [1, H_q, W, D] per layer (scorers' input)
    """
    from ..hf.support import ModelGeometry

    geo = ModelGeometry.of(model)
    dtype = next(model.parameters()).dtype
    B, T = token_ids.shape
    H, D = geo.num_kv_heads, geo.head_dim
    gen = torch.Generator().manual_seed(seed)
    states = []
    for _ in range(geo.num_layers):
        protos = torch.randn(B, H, prototypes, D, generator=gen)
        pick = torch.randint(0, prototypes, (B, H, T), generator=gen)
        keys = protos.gather(2, pick[..., None].expand(B, H, T, D))
        keys.add_(torch.randn(B, H, T, D, generator=gen), alpha=0.6)
        values = torch.randn(B, H, T, D, generator=gen)
        st = KVState.from_raw(keys.to(dtype), values.to(dtype), token_ids=token_ids, vocab=vocab)
        if query_window > 0:
            q = torch.randn(B, geo.num_q_heads, min(query_window, T), D, generator=gen).to(dtype)
            st = st.replace(extras={"queries": q})
        states.append(st)
    return Snapshot(states=states, token_ids=token_ids.clone(), vocab=None if vocab is None else tuple(vocab),
                    geometry=geo, backend="sdpa")


def stock_cache(model, snapshot: Snapshot):
    """A transformers ``DynamicCache`` holding the snapshot's keys/values (copies)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        for i, st in enumerate(snapshot.states):
            cache.update(st.keys.clone(), st.values.clone(), i)
    return cache


def uncompressed_cache(model, snapshot: Snapshot, backend: str):
    """A ``CompressedCache`` without a pipeline holding the snapshot, bound to ``model``."""
    from ..hf import CompressedCache

    return CompressedCache.from_states(snapshot.states, None, vocab=snapshot.vocab, backend=backend,
                                       geometry=snapshot.geometry, model=model)


@dataclasses.dataclass
class Built:
    """A compressed cache and what building it cost.

    compress_s: pipeline time (``cache.stats["compress_s"]``, all layers)
    copy_s:     the whole copy (buffers + pipeline)
    """

    cache: object
    compress_s: float
    copy_s: float
    budget_met: bool
    keep_mean: float
    keep_max: float
    reconstruct_s: float | None = None  # the model pass before the compression (needs.model_pass)


def compressed_cache(model, snapshot: Snapshot, config, backend: str, tokenizer=None) -> Built:
    """``snapshot`` compressed by ``config`` (a PipelineConfig) into a cache bound to ``model``.

    tokenizer: builds the reconstruction pass's repeat prompt for pipelines that need the model
               pass (without one, e.g. the tiny test model, the context's first tokens stand in)
    """
    from ..pipeline import Pipeline

    pipe = Pipeline(config)
    if pipe.needs.model_pass:
        return _with_model_pass(model, snapshot, pipe, backend, tokenizer)
    copy_ = compressed_copy(model, dataclasses.replace(snapshot, backend=backend), config)
    cache = copy_.cache
    return Built(cache, float(cache.stats["compress_s"]), copy_.compress_s, copy_.layers_met,
                 copy_.keep_mean, copy_.keep_max)


STAND_IN_PROMPT = 8  # tokens of the context used as the repeat prompt when there is no tokenizer


def _with_model_pass(model, snapshot: Snapshot, pipe, backend: str, tokenizer) -> Built:
    """A cache bound to ``model`` holding the snapshot, the reconstruction pass registered as its
    prefill hook (what ``CompressedCache.for_model`` does for such a pipeline), compressed."""
    from ..hf import CompressedCache
    from ..hf.reconstruct import prefill_hook

    # what this pipeline's own cache would have recorded, nothing more
    states = [as_needed(st, pipe.needs, pipe.config.name) for st in snapshot.states]
    start = time.perf_counter()
    cache = CompressedCache.from_states(states, pipe, vocab=snapshot.vocab, backend=backend,
                                        geometry=snapshot.geometry, model=model)
    hook = (prefill_hook(tokenizer) if tokenizer is not None
            else prefill_hook(repeat_ids=snapshot.token_ids[:1, :STAND_IN_PROMPT].clone()))
    cache.add_prefill_hook(hook)
    with torch.inference_mode():
        cache.compress()
    copy_s = time.perf_counter() - start
    reconstruct_s = float(cache.stats.get("reconstruct_s", 0.0))
    keep_mean, keep_max, met, _ = keep_reached(cache)
    return Built(cache, float(cache.stats["compress_s"]), copy_s - reconstruct_s, met, keep_mean, keep_max,
                 reconstruct_s)


def clone_cache(cache, model, backend: str | None = None):
    """An independent deep copy of a bound ``CompressedCache`` (pipeline shared), bound to the
    same model; ``backend`` replaces the copy's attention backend."""
    from ..hf import Backends, CompressedCache

    require(isinstance(cache, CompressedCache), "cache", type(cache).__name__, "a kvcompress CompressedCache")
    twin = copy.deepcopy(cache)
    if backend is not None:
        twin.backends = Backends(backend)
    return twin


def release(cache) -> None:
    close = getattr(cache, "close", None)
    if callable(close):
        close()


def kv_bytes(cache) -> dict:
    """full: K+V bytes of an uncompressed cache for the tokens seen; held: bytes of the slots in
    use (keys, values, log-sizes; padding slots of shorter heads included); allocated: every
    buffer (spare capacity, positions and per-slot statistics included)."""
    if hasattr(cache, "kv_bytes") and hasattr(cache, "allocated_bytes"):
        return {"full": int(cache.full_kv_bytes()), "held": int(cache.kv_bytes()),
                "allocated": int(cache.allocated_bytes())}
    total = 0
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            if t is not None:
                total += t.numel() * t.element_size()
    return {"full": total, "held": total, "allocated": total}


def slots(cache) -> dict:
    """Slot counts of a CompressedCache (mean valid slots per head, max tensor slots), else {}."""
    if not hasattr(cache, "slots_per_layer"):
        return {}
    per_layer = cache.slots_per_layer()
    valid = cache.valid_slots_per_layer()
    return {"tensor_slots_max": max(per_layer), "tensor_slots_mean": sum(per_layer) / len(per_layer),
            "valid_slots_mean": sum(valid) / len(valid), "tokens": cache.num_tokens}


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def plain_twin(model, implementation: str = "sdpa"):
    """A second module tree over the SAME weights (no copy of any parameter or buffer) running
    transformers' own ``implementation`` attention, with no hooks: decoding a stock
    ``DynamicCache`` with it runs no kvcompress code at all, while the caches bound to ``model``
    keep their hooks and attention. Make it before any cache is bound (hooks are not copied
    anyway: they are cleared on the twin)."""
    memo = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    twin = copy.deepcopy(model, memo)
    for module in twin.modules():
        module._forward_hooks.clear()
        module._forward_pre_hooks.clear()
        for name in ("_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called"):
            getattr(module, name, {}).clear()
    twin.set_attn_implementation(implementation)
    return twin


def shares_weights(a, b) -> bool:
    """Every parameter of ``a`` is the very tensor storage of ``b``'s parameter of that name."""
    pb = dict(b.named_parameters())
    return all(n in pb and p.data_ptr() == pb[n].data_ptr() for n, p in a.named_parameters())
