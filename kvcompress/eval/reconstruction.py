"""The evaluation's use of the reconstruction pass: score a snapshot once, compress copies with it.

A pipeline whose ``needs.model_pass`` is set (the ``reconstruction`` scorer, the ``importance``
guard) needs a model pass after the prefill. The evaluation prefills once per sample
(``Recorder``); here the pass runs once per snapshot over its states (the repeat prompt, then the
cached tokens teacher forced) and its scores become the per-slot statistic ``stats["reconstruction"]``
of the snapshot's states (the sampled queries ``extras["reconstruction_queries"]``), which
``compressed_copy`` carries into every copy: every method of the sample that needs the pass reuses
it. Pipelines that do not need it get copies without it. A pipeline that declares
``Needs(surprisal=True)`` also gets each context token's prefill surprisal (``extras["surprisal"]``,
one forward of the model per snapshot, as a live cache's prefill hook computes it).
"""

from __future__ import annotations

import time

from ..config import PipelineConfig
from ..hf.reconstruct import (COPY_KEY, DEFAULT_CHUNK, QUERIES_KEY, STATS_KEY, SURPRISAL_KEY, prefill_surprisal,
                              reconstruction_scores, repeat_prompt_ids)
from ..pipeline import Pipeline
from ..validation import require
from .caches import Copy, Snapshot, compressed_copy

QUERY_SAMPLES = 64  # reconstruction queries kept per layer (extras["reconstruction_queries"])


def attach_reconstruction(model, tokenizer, snapshot: Snapshot, *, chunk: int = DEFAULT_CHUNK,
                          subsample: float = 1.0, surprisal: bool = False, lead: int = 0,
                          aligned: bool = False) -> float:
    """Attach the pass's scores to ``snapshot``'s states (stats["reconstruction"] [B, H, T],
    extras["reconstruction_queries"], the per-head copy scores extras["reconstruction_copy"] [B, H]),
    running it first unless a pass with these parameters already ran over the snapshot
    (``snapshot.passes``); with ``surprisal``, also each context token's prefill surprisal
    (``prefill_surprisal``, once) as extras["surprisal"] [B, T], the same tensor in every layer.
    Returns the seconds spent (0.0 when nothing had to run).

    The repeat prompt is the one a live cache uses (``CompressedCache.for_model`` registers
    ``prefill_hook(tokenizer)``; ``chunk``, ``subsample``, ``lead``, ``aligned``: ``reconstruction_scores``'s): the
    tokenizer's chat template when it has one, whatever template the evaluated prompt itself used,
    so that a figure measured here is the figure of real use."""
    seconds = 0.0
    require(model is not None, "model", None, "the model (the reconstruction pass runs it over the context)")
    if surprisal and SURPRISAL_KEY not in snapshot.states[0].extras:
        start = time.perf_counter()
        sur = prefill_surprisal(model, snapshot.token_ids)
        seconds += time.perf_counter() - start
        for i, st in enumerate(snapshot.states):
            snapshot.states[i] = st.replace(extras={**st.extras, SURPRISAL_KEY: sur})
    key = (chunk, float(subsample), lead, aligned)
    rec = snapshot.passes.get(key)
    if rec is None:
        require(tokenizer is not None, "tokenizer", None, "the tokenizer (to build the repeat prompt)")
        rec = reconstruction_scores(model, snapshot.states, snapshot.token_ids, repeat_ids=repeat_prompt_ids(tokenizer),
                                    chunk=chunk, subsample=subsample, query_samples=QUERY_SAMPLES, lead=lead,
                                    aligned=aligned)
        seconds += rec.seconds
        snapshot.passes[key] = rec
    for i, st in enumerate(snapshot.states):
        extras = {k: v for k, v in st.extras.items() if k != QUERIES_KEY}
        if rec.queries[i] is not None:
            extras[QUERIES_KEY] = rec.queries[i]
        extras[COPY_KEY] = rec.copy[i]
        snapshot.states[i] = st.replace(stats={**st.stats, STATS_KEY: rec.scores[i]}, extras=extras)
    return seconds


def _without_pass(snapshot: Snapshot) -> Snapshot:
    """The snapshot without the pass's statistic and queries (for pipelines that do not read them)."""
    if STATS_KEY not in snapshot.states[0].stats:
        return snapshot
    states = [st.replace(stats={k: v for k, v in st.stats.items() if k != STATS_KEY},
                         extras={k: v for k, v in st.extras.items() if k not in (QUERIES_KEY, SURPRISAL_KEY, COPY_KEY)})
              for st in snapshot.states]
    return Snapshot(states=states, token_ids=snapshot.token_ids, vocab=snapshot.vocab, geometry=snapshot.geometry,
                    backend=snapshot.backend)


def copy_for(model, tokenizer, snapshot: Snapshot, config: PipelineConfig, *, protect=(), marks=None) -> Copy:
    """``compressed_copy``, running the reconstruction pass first (once per snapshot) when
    ``config``'s pipeline needs it. The copy carries ``reconstruct_s`` (the pass's seconds, with
    the surprisal forward when one ran, the first time; 0 after, or when no pass ran)."""
    needs = Pipeline(config).needs
    if not needs.model_pass:
        copy = compressed_copy(model, _without_pass(snapshot), config, protect=protect, marks=marks)
        copy.reconstruct_s = 0.0
        return copy
    seconds = attach_reconstruction(model, tokenizer, snapshot, surprisal=needs.surprisal, lead=needs.pass_lead,
                                    aligned=needs.pass_aligned)
    copy = compressed_copy(model, snapshot, config, protect=protect, marks=marks)
    copy.reconstruct_s = seconds
    return copy
