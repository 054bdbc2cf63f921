"""Prefill once, compress copies: the evaluation's use of ``kvcompress.hf``.

``Recorder`` prefills a prompt into an uncompressed ``CompressedCache`` (no pipeline) that records
what the methods need (``Needs``: the last queries of each layer, strided reference queries, the
attention each token received). ``snapshot()`` freezes the per-layer ``KVState``s
(``cache.states()``). ``compressed_copy`` then builds, for any pipeline, a new cache from that
snapshot with ``CompressedCache.from_states`` and compresses it with ``cache.compress()``: the
prefill rule of a real prefill (cross-layer guards see every layer), without running the model.
The copy is bound to the model for decoding. One model prefill serves every method.

``compressed_copy`` can protect token spans in every layer and head (an oracle that knows where
the needle is: ``cache.compress(protect=...)``) and traces span markers through the merge: a
per-slot count of marked tokens that merging sums over members (a stat), so after compression
each slot says how many needle tokens it holds and how many tokens in all.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..budget import LAYER_SCALE
from ..config import PipelineConfig
from ..pipeline import Pipeline
from ..protocols import Needs
from ..types import KVState
from ..validation import require

MARK_PREFIX = "eval_mark:"


@dataclass
class Snapshot:
    """Per-layer states of an uncompressed prefill (cloned: later appends cannot touch them).

    states:    one KVState per layer, keys/values [B, H, T, D]; extras may hold "queries"
               [B, Hq, W, D] and "reference_queries" [B, Hq, R, D], stats "attn_acc" [B, H, T]
    token_ids: [B, T] long
    passes:    the reconstruction passes run over it, by their parameters (``attach_reconstruction``:
               each runs once however many methods read it)
    """

    states: list
    token_ids: Tensor
    vocab: tuple | None
    geometry: object
    backend: str
    passes: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[1])


def recording_needs(configs) -> Needs:
    """What a recorder must record to serve every config (their pipelines' ``needs``)."""
    return Needs.union(Pipeline(c).needs for c in configs)


def needs_of(configs) -> tuple[int, bool]:
    """(query window, track attention) a recorder needs to serve every config (no reference
    queries: use ``Recorder.for_configs`` to record everything, e.g. for the fitted merger)."""
    needs = recording_needs(configs)
    return needs.query_window, needs.attention


class Recorder:
    """An uncompressed cache that records inputs, queries and attention for later compression.

        rec = Recorder(model, tokenizer, query_window=32, track_attention=False)
        rec.feed(ids)            # [1, T] long: one model prefill
        snap = rec.snapshot()

    needs: what to record (overrides query_window / track_attention), e.g. ``recording_needs(configs)``
    """

    def __init__(self, model, tokenizer=None, *, query_window: int = 0, track_attention: bool = False,
                 backend: str = "auto", vocab=None, needs: Needs | None = None):
        from ..hf import CompressedCache

        if needs is None:
            needs = Needs(query_window=query_window, attention=track_attention)
        # only what a prefill records: the model-pass and all-layer needs belong to the copies
        needs = Needs(query_window=needs.query_window, reference_queries=needs.reference_queries,
                      attention=needs.attention)
        self.needs = needs
        self.model = model
        self.cache = CompressedCache.for_model(model, tokenizer, None, backend=backend, vocab=vocab, record=needs)
        self.backend = backend
        self.forwards = 0
        self.prefill_s = 0.0

    @classmethod
    def for_configs(cls, model, tokenizer, configs, *, backend: str = "auto", vocab=None) -> "Recorder":
        """A recorder of everything the pipelines of ``configs`` need (``recording_needs``): their
        query window, attention statistics and strided reference queries (the fitted merger's)."""
        return cls(model, tokenizer, backend=backend, vocab=vocab, needs=recording_needs(configs))

    def feed(self, ids: Tensor, *, logits: bool = False) -> Tensor | None:
        """Run the model over ``ids`` [1, q] on top of what was fed; returns logits [1, q, V] when
        ``logits`` (else the base model runs, no [q, V] logits are built)."""
        from ..hf.generate import cache_kwarg

        require(ids.dim() == 2 and ids.shape[1] >= 1, "ids", tuple(ids.shape), "a [B, q] tensor with q >= 1")
        module = self.model if logits else self.model.base_model
        start = time.perf_counter()
        with torch.inference_mode():
            out = module(input_ids=ids, use_cache=True, **{cache_kwarg(module): self.cache})
        self.prefill_s += time.perf_counter() - start
        self.forwards += 1
        return out.logits if logits else None

    def snapshot(self) -> Snapshot:
        states = []
        for st in self.cache.states():
            require(st is not None, "model", "a sliding-window layer", "full-attention layers only for a Recorder")
            extras = {k: v.clone() if isinstance(v, Tensor) else v for k, v in st.extras.items()
                      if k in ("queries", "reference_queries")}
            stats = {k: v.clone() for k, v in st.stats.items() if k == "attn_acc"}
            states.append(st.replace(keys=st.keys.clone(), values=st.values.clone(),
                                     log_sizes=st.log_sizes.clone(), positions=st.positions.clone(),
                                     token_ids=st.token_ids.clone(), extras=extras, stats=stats))
        return Snapshot(states=states, token_ids=self.cache.token_ids.clone(), vocab=self.cache.vocab,
                        geometry=self.cache.geometry, backend=self.backend)

    def close(self) -> None:
        self.cache.close()


# ---------------------------------------------------------------------------- compressed copies
def span_tokens(spans, batch: int, num_tokens: int, device=None) -> Tensor | None:
    """[B, T] bool: the tokens of ``spans`` [(start, end), ...] (None for no spans), as
    ``CompressedCache.compress(protect=...)`` takes them."""
    spans = tuple(spans or ())
    if not spans:
        return None
    pos = torch.arange(num_tokens, device=device)
    mask = torch.zeros(num_tokens, dtype=torch.bool, device=device)
    for a, b in spans:
        mask |= (pos >= a) & (pos < b)
    return mask.expand(batch, num_tokens).clone()


def with_marks(state: KVState, marks: dict) -> KVState:
    """``state`` (uncompressed) with one per-slot statistic per mark (name -> (start, end)):
    1 on the marked tokens. Mergers sum it over members, so once compressed each slot says how
    many marked tokens it holds."""
    if not marks:
        return state
    pos = state.positions  # [B, H, N]; before the first compression a slot is one token
    stats = dict(state.stats)
    for name, (a, b) in marks.items():
        stats[MARK_PREFIX + name] = ((pos >= a) & (pos < b)).float()
    return state.replace(stats=stats)


def trace_mark(state: KVState, count: Tensor, length: int) -> dict:
    """Where the ``length`` marked tokens went, averaged over batch and heads.

    count: [B, H, N] marked tokens per slot (merging sums it over members)
    kept:  share of marked tokens still in the cache (eviction drops them)
    alone: share still in a slot of their own (size 1)
    mixed: share merged with unmarked tokens
    slots: slots holding marked tokens; size: mean size of those slots
    """
    valid = state.valid
    size = state.token_counts().masked_fill(~valid, 0.0)  # [B, H, N] tokens, not exp(bias): a fitted bias differs
    count = count.masked_fill(~valid, 0.0)
    has = count > 1e-6
    n = float(max(length, 1))
    per_head_slots = has.sum(-1).float()  # [B, H]
    sizes = torch.where(has, size, 0.0).sum(-1) / per_head_slots.clamp(min=1)
    return {
        "kept": float(count.sum(-1).mean() / n),
        "alone": float((has & (size < 1.5)).sum(-1).float().mean() / n),
        "mixed": float(torch.where(has & (size > count + 1e-4), count, 0.0).sum(-1).mean() / n),
        "slots": float(per_head_slots.mean()),
        "size": float(sizes.mean()),
    }


@dataclass
class Copy:
    """A compressed copy: the cache (bound to the model) and what the compression achieved."""

    cache: object
    compress_s: float
    keep_max: float  # max over layers and heads of slots / tokens (/ the layer's budget factor, when it has one)
    keep_mean: float  # mean over layers and heads of slots / tokens
    layers_met: bool  # every layer's pipeline report said the budget was met
    trace: dict = field(default_factory=dict)  # mark name -> means over layers of trace_mark
    keep_total: float | None = None  # the cache's size: sum over layers of the largest head's slots / (L * tokens)

    def meets(self, budget: float) -> bool:
        """Every head within its layer's share of ``budget`` and the cache within ``budget``."""
        total = self.keep_max if self.keep_total is None else self.keep_total
        return bool(self.keep_max <= budget + 1e-9 and total <= budget + 1e-9)


def as_needed(state: KVState, needs: Needs, name: str) -> KVState:
    """The snapshot's state with what this pipeline needs: its query window (the last W
    queries), reference queries and attention statistics, nothing more."""
    queries = state.extras.get("queries")
    window = needs.query_window
    require(window == 0 or (queries is not None and queries.shape[2] >= min(window, state.num_tokens)),
            "snapshot", f"query window {0 if queries is None else queries.shape[2]}",
            f"a recorder with query_window >= {window} for pipeline {name!r}")
    reference = state.extras.get("reference_queries")
    R = needs.reference_queries
    # a stride of R over the prefill is not a subset of another R': the count must be the same
    require(R == 0 or (reference is not None and reference.shape[2] == R), "snapshot",
            f"reference queries {None if reference is None else reference.shape[2]}",
            f"a recorder with reference_queries == {R} for pipeline {name!r} (Recorder.for_configs; "
            "methods of one grid must agree on reference_queries)")
    require(not needs.attention or "attn_acc" in state.stats, "snapshot", "no attention statistics",
            f"a recorder with track_attention=True for pipeline {name!r}")
    extras = {k: v for k, v in state.extras.items() if k not in ("queries", "reference_queries")}
    if window:
        extras["queries"] = queries[:, :, -window:]
    if R:
        extras["reference_queries"] = reference
    stats = {k: v for k, v in state.stats.items() if k != "attn_acc" or needs.attention}
    return state.replace(extras=extras, stats=stats)


def compressed_copy(model, snapshot: Snapshot, config: PipelineConfig, *, protect=(), marks=None) -> Copy:
    """A new cache for ``model`` holding ``snapshot`` compressed by ``config``.

    The snapshot is not modified. protect: token spans [(start, end), ...] no layer or head
    merges or drops in this compression (an oracle that knows where the needle is); marks: name
    -> (start, end) token spans traced through the merge (``trace_mark``), in ``Copy.trace``.
    """
    from ..hf import CompressedCache

    marks = dict(marks or {})
    pipe = Pipeline(config)
    states = [with_marks(as_needed(st, pipe.needs, config.name), marks) for st in snapshot.states]
    cache = CompressedCache.from_states(states, pipe, vocab=snapshot.vocab, backend=snapshot.backend,
                                        geometry=snapshot.geometry)
    tokens = span_tokens(protect, snapshot.token_ids.shape[0], snapshot.num_tokens, snapshot.token_ids.device)
    start = time.perf_counter()
    with torch.inference_mode():
        cache.compress(protect=tokens)
    compress_s = time.perf_counter() - start

    keep_mean, keep_max, met, keep_total = keep_reached(cache)
    traces: dict[int, dict] = {}
    for i in cache.compressed_layer_ids():
        report = cache.layers[i].last_report
        if marks and report is not None:
            st = cache.layer_state(i)
            traces[i] = {name: trace_mark(st, st.stats[MARK_PREFIX + name], b - a) for name, (a, b) in marks.items()}
    for name in marks:
        cache.drop_stats(MARK_PREFIX + name)  # traced; decoding need not carry them
    cache.bind(model)
    trace = {}
    if traces:
        for name in marks:
            rows = [t[name] for t in traces.values()]
            trace[name] = {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}
            trace[name]["alone_per_layer"] = [round(traces[i][name]["alone"], 3) for i in sorted(traces)]
    return Copy(cache=cache, compress_s=compress_s, keep_max=keep_max, keep_mean=keep_mean, layers_met=met,
                trace=trace, keep_total=keep_total)


def keep_reached(cache) -> tuple[float, float, bool, float]:
    """(mean keep, worst keep, every layer met its budget, total keep) of a compressed
    ``CompressedCache`` over its compressed layers: slots per head / real tokens seen (left padding
    excluded). The worst keep is relative to the layer's share of the budget (``LAYER_SCALE``,
    a layer given twice an even share may keep twice as much); the total keep is the cache's size,
    the sum over layers of the largest head's slots over L * tokens (the worst row's)."""
    ratios, scaled, widest, met = [], [], [], True
    skip = 0 if cache.seq_start is None else int(cache.seq_start.max())
    for i in cache.compressed_layer_ids():
        layer = cache.layers[i]
        keep = layer.valid_slots().double() / max(layer.num_tokens - skip, 1)  # [B, H] (float32 reads 200/1000 as > 0.2)
        scale = layer.extras.get(LAYER_SCALE)
        ratios.append(keep)
        scaled.append(keep if scale is None else keep / scale.to(keep)[:, None])
        widest.append(keep.max(-1).values)  # [B]
        met = met and (layer.last_report is None or bool(layer.last_report.budget_met))
    keep = torch.stack(ratios)  # [L, B, H]
    total = torch.stack(widest).mean(0).max()  # [L, B] -> the worst row
    return float(keep.mean()), float(torch.stack(scaled).max()), met, float(total)
