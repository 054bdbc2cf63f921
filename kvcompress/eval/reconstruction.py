"""The evaluation's use of the reconstruction pass: score a snapshot once, compress copies with it.

A pipeline that reads the ``reconstruction`` statistic (``pipeline_needs_model_pass``) needs a
model pass after the prefill. The evaluation prefills once per sample (``Recorder``); here the
pass runs once per snapshot over its states (the repeat prompt, then the cached tokens teacher
forced), its scores are attached to the snapshot's states, and ``copy_for`` builds each
compressed copy with them. Pipelines that do not need it go to ``compressed_copy`` unchanged.
"""

from __future__ import annotations

import time

import torch

from ..config import PipelineConfig
from ..hf.reconstruct import DEFAULT_CHUNK, QUERIES_KEY, STATS_KEY, reconstruction_scores, repeat_prompt_ids
from ..strategies.importance import pipeline_needs_model_pass
from ..validation import require
from .caches import Copy, Snapshot, _EvalPipeline, compressed_copy

QUERY_SAMPLES = 64  # reconstruction queries kept per layer (extras["reconstruction_queries"])


def attach_reconstruction(model, tokenizer, snapshot: Snapshot, *, chat: bool | None = None,
                          chunk: int = DEFAULT_CHUNK, subsample: float = 1.0) -> float:
    """Run the pass over ``snapshot`` (once: a second call returns 0.0) and attach the scores to its
    states (extras["reconstruction"] [B, H, T], extras["reconstruction_queries"]). Returns seconds."""
    if STATS_KEY in snapshot.states[0].extras:
        return 0.0
    repeat = repeat_prompt_ids(tokenizer, chat)
    rec = reconstruction_scores(model, snapshot.states, snapshot.token_ids, repeat_ids=repeat, chunk=chunk,
                                subsample=subsample, query_samples=QUERY_SAMPLES)
    for i, st in enumerate(snapshot.states):
        extras = {**st.extras, STATS_KEY: rec.scores[i]}
        if rec.queries[i] is not None:
            extras[QUERIES_KEY] = rec.queries[i]
        snapshot.states[i] = st.replace(extras=extras)
    return rec.seconds


def copy_for(model, tokenizer, snapshot: Snapshot, config: PipelineConfig, *, chat: bool | None = None,
             protect=(), marks=None) -> Copy:
    """``compressed_copy``, running the reconstruction pass first when ``config`` needs it.
    The copy carries ``reconstruct_s`` (0 when the snapshot was already scored or no pass ran)."""
    if not pipeline_needs_model_pass(config):
        copy = compressed_copy(model, snapshot, config, protect=protect, marks=marks)
        copy.reconstruct_s = 0.0
        return copy
    seconds = attach_reconstruction(model, tokenizer, snapshot, chat=chat)
    copy = _copy_with_stats(model, snapshot, config, protect=protect, marks=marks)
    copy.reconstruct_s = seconds
    return copy


def _copy_with_stats(model, snapshot: Snapshot, config: PipelineConfig, *, protect=(), marks=None) -> Copy:
    """As ``compressed_copy``, with each state's per-slot reconstruction statistic handed to its
    layer before the layer compresses."""
    from ..hf import CompressedCache
    from ..hf.attention import STEP_KEY

    pipe = _EvalPipeline(config, protect=protect, marks=marks)
    cache = CompressedCache(pipe, num_layers=len(snapshot.states), vocab=snapshot.vocab, backend=snapshot.backend,
                            geometry=snapshot.geometry)
    window = config.query_window
    start = time.perf_counter()
    with torch.inference_mode():
        cache.set_inputs(input_ids=snapshot.token_ids)
        for i, (layer, st) in enumerate(zip(cache.layers, snapshot.states)):
            queries = st.extras.get("queries")
            require(window == 0 or (queries is not None and queries.shape[2] >= min(window, st.num_tokens)),
                    "snapshot", f"query window {0 if queries is None else queries.shape[2]}",
                    f"a recorder with query_window >= {window} for pipeline {config.name!r}")
            kwargs: dict = {}
            layer.update(st.keys, st.values, i, kwargs=kwargs)
            layer.extras[STATS_KEY] = st.extras[STATS_KEY]  # a [B, H, N] slot statistic once compressed
            received = st.extras.get("attn_acc") if config.track_attention else None
            kwargs[STEP_KEY].finish(queries if queries is not None else st.keys.new_zeros(0), received)
    compress_s = time.perf_counter() - start
    cache.bind(model)
    ratios, met = [], True
    for layer in cache.layers:
        tokens = max(layer.num_tokens - (0 if cache.seq_start is None else int(cache.seq_start.max())), 1)
        ratios.append(layer.valid_slots().float() / tokens)
        met = met and (layer.last_report is None or bool(layer.last_report.budget_met))
    ratios_t = torch.stack(ratios)
    trace = {}
    if pipe.traces:
        for name in pipe.marks:
            rows = [t[name] for t in pipe.traces.values()]
            trace[name] = {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}
    return Copy(cache=cache, compress_s=compress_s, keep_max=float(ratios_t.max()), keep_mean=float(ratios_t.mean()),
                layers_met=met, trace=trace)
