"""Compression cost against the plain prefill, and its growth with the context length.

- ``compression_seconds``: one pipeline over every layer's state, as the transformers cache does
  it at the prefill's end (cross-layer guards prepared from all layers, then each layer
  compressed), after one untimed warm-up compression of layer 0.
- ``cost_rounds``: rounds of [plain prefill, every preset]: each round gives the preset's
  share of *that round's* prefill, so a change of load between rounds hits both sides alike;
  the reported share is the median over rounds.
- ``scaling``: one layer of synthetic keys (prototypes + noise, Llama-3-8B-shaped heads) at
  several lengths; the log-log slope of time against N says whether the cost is linear.

Presets that read attention statistics (``track_attention``) or the reconstruction statistic
(the question-free importance presets) get random positive ones (``stats_note``): their cost
does not depend on the values. Recording real attention at 8k would need the prefill's
attention matrices; the reconstruction pass is a model forward by design and is timed apart
(``reconstruction_seconds``), not counted as compression. A fitted merger's fit is part of its
compression and is counted.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Callable, Sequence

import torch

from ..strategies.importance import COPY, STAT as RECONSTRUCTION, SURPRISAL
from ..types import KVState
from .machine import load_average

STATS_NOTE = ("presets with track_attention read random positive attn_acc, and presets reading the reconstruction "
              "statistic random positive scores (their cost does not depend on the values; recording real attention "
              "needs the prefill's attention matrices; the reconstruction pass is a model forward, timed apart)")


def with_inputs(states: Sequence[KVState], config, seed: int = 0) -> list[KVState]:
    """The states with what ``config``'s scorers read: ``extras["queries"]`` of exactly its
    query window (the last ones; repeated along the window when the snapshot holds fewer, none
    when the pipeline needs no queries) and, with
    ``track_attention``, a random positive ``stats["attn_acc"]`` [B, H, N]; when a strategy reads
    the reconstruction statistic, a random positive ``stats["reconstruction"]`` [B, H, N] and a random
    ``extras["reconstruction_copy"]`` [B, H] (the pass's copy score per KV head); when it
    needs the prefill surprisal, a random ``extras["surprisal"]`` [B, T]."""
    from ..pipeline import Pipeline

    gen = torch.Generator().manual_seed(seed)
    needs = Pipeline(config).needs
    model_pass, window = needs.model_pass, needs.query_window
    out = []
    surprisal = torch.rand(states[0].batch_size, states[0].num_slots, generator=gen) * 10 if states else None
    for st in states:
        extras = dict(st.extras)
        q = extras.pop("queries", None)
        if window and q is not None:
            # exactly the window a cache built for this pipeline records (the snapshot may hold
            # a longer one, recorded for another preset: the query scorers' cost grows with it)
            reps = -(-window // q.shape[2])
            extras["queries"] = (torch.cat([q] * reps, 2) if reps > 1 else q)[:, :, -window:]
        stats = dict(st.stats)
        if config.track_attention:
            stats["attn_acc"] = torch.rand(st.keys.shape[:3], generator=gen)
        if model_pass and RECONSTRUCTION not in stats:
            stats[RECONSTRUCTION] = torch.rand(st.keys.shape[:3], generator=gen)
        if model_pass and COPY not in extras:
            # the reconstruction pass's per-KV-head copy score [B, H] (read by copy-head guards)
            extras[COPY] = torch.rand(st.batch_size, st.num_heads, generator=gen)
        if needs.surprisal and SURPRISAL not in extras:
            # one value per context token, the same tensor in every layer (as the prefill hook writes it)
            extras[SURPRISAL] = surprisal
        out.append(st.replace(extras=extras, stats=stats))
    return out


def compression_seconds(config, states: Sequence[KVState], warmup: bool = True) -> tuple[float, float]:
    """(wall, cpu) seconds of ``Pipeline(config)`` preparing from ``states`` and compressing each.

    states: one KVState per layer (as a prefill leaves them)
    """
    from ..pipeline import Pipeline
    from ..strategies import scratch

    states = with_inputs(states, config)
    with torch.inference_mode():
        if warmup:
            pipe = Pipeline(config)
            pipe.prepare(states)
            pipe.compress(states[0], 0)
        pipe = Pipeline(config)  # fresh: no decision carried over from the warm-up
        scratch.clear()  # nor pages: a round starts with an empty pool, as a cache's round does
        with scratch.compression_round():
            wall, cpu = time.perf_counter(), time.process_time()
            if pipe.needs_all_layers:
                pipe.prepare(states)
            for i, st in enumerate(states):
                pipe.compress(st, i)
            return time.perf_counter() - wall, time.process_time() - cpu


def reconstruction_seconds(model, tokenizer, states: Sequence[KVState], ids, **kwargs) -> float:
    """Seconds of one context-reconstruction pass (``kvcompress.hf.reconstruct``) over ``states``:
    the model forward the question-free importance presets need before they compress.

    ids: [1, T] the context the states hold; kwargs go to ``reconstruction_scores``
    """
    from ..hf.reconstruct import reconstruction_scores, repeat_prompt_ids

    start = time.perf_counter()
    reconstruction_scores(model, list(states), ids, repeat_ids=repeat_prompt_ids(tokenizer), **kwargs)
    return time.perf_counter() - start


def cost_rounds(prefill: Callable[[], float | tuple[float, float]], configs: dict, states: Sequence[KVState],
                rounds: int = 3, log=None) -> dict:
    """Per preset, its compression time as a share of the plain prefill, round by round.

    prefill: runs one plain prefill, returns its seconds, or (wall, cpu) seconds
    configs: {name: PipelineConfig}
    returns  {"rounds": [...], "presets": {name: {"share_median", "shares", "compress_s", ...}}}

    With CPU seconds from ``prefill`` the CPU-time shares are reported too (``cpu_share_median``):
    on a machine with more runnable threads than cores, wall time also counts the time a job
    waits for a core, which small memory-bound operations suffer more from than a prefill's
    large matrix products; process time counts only the work.
    """
    doc = {"rounds": [], "presets": {}}
    for r in range(rounds):
        rec = {"round": r, "load_average_start": load_average()}
        got = prefill()
        rec["prefill_s"], rec["prefill_cpu_s"] = got if isinstance(got, tuple) else (got, None)
        rec["compress_s"], rec["compress_cpu_s"] = {}, {}
        for name, cfg in configs.items():
            wall, cpu = compression_seconds(cfg, states)
            rec["compress_s"][name] = wall
            rec["compress_cpu_s"][name] = cpu
            if log:
                cpu_part = f", cpu {cpu / rec['prefill_cpu_s']:.2%}" if rec["prefill_cpu_s"] else ""
                log(f"round {r} {name}: {wall:.3f} s = {wall / rec['prefill_s']:.2%} of the prefill{cpu_part}")
        rec["load_average_end"] = load_average()
        doc["rounds"].append(rec)
    for name in configs:
        shares = [rec["compress_s"][name] / rec["prefill_s"] for rec in doc["rounds"]]
        secs = [rec["compress_s"][name] for rec in doc["rounds"]]
        entry = {"share_median": statistics.median(shares), "shares": shares,
                 "compress_s": secs, "compress_s_median": statistics.median(secs)}
        if all(rec["prefill_cpu_s"] for rec in doc["rounds"]):
            cpu = [rec["compress_cpu_s"][name] / rec["prefill_cpu_s"] for rec in doc["rounds"]]
            entry.update(cpu_share_median=statistics.median(cpu), cpu_shares=cpu)
        doc["presets"][name] = entry
    return doc


def synthetic_states(num_tokens: int, *, heads: int = 8, head_dim: int = 128, q_heads: int = 32, window: int = 64,
                     layers: int = 1, token_ids=None, vocab=None, seed: int = 0, prototypes: int = 64) -> list[KVState]:
    """Llama-3-8B-shaped states [1, heads, N, head_dim]: keys around ``prototypes`` random
    directions plus noise (so similarity methods find structure), Gaussian values, random queries."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(layers):
        protos = torch.randn(1, heads, prototypes, head_dim, generator=gen)
        pick = torch.randint(0, prototypes, (1, heads, num_tokens), generator=gen)
        keys = protos.gather(2, pick[..., None].expand(1, heads, num_tokens, head_dim))
        keys.add_(torch.randn(keys.shape, generator=gen), alpha=0.6)
        values = torch.randn(1, heads, num_tokens, head_dim, generator=gen)
        st = KVState.from_raw(keys, values, token_ids=token_ids, vocab=vocab)
        q = torch.randn(1, q_heads, min(window, num_tokens), head_dim, generator=gen)
        out.append(st.replace(extras={"queries": q}))
    return out


def loglog_slope(lengths: Sequence[int], seconds: Sequence[float]) -> float:
    """Least-squares slope of log(seconds) against log(length)."""
    xs = [math.log(n) for n in lengths]
    ys = [math.log(max(s, 1e-12)) for s in seconds]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else float("nan")


REFERENCE = "linear reference"  # scaling(): the name of the memory pass timed beside the presets


def reference_pass(states: Sequence[KVState]) -> None:
    """A pass of certainly linear cost over the states, moving memory as compression does (unit keys,
    a copy of the values, one reduction): its slope against N is the machine's own (caches, page
    faults, other processes), the floor a preset's slope is read against."""
    for st in states:
        kn = torch.nn.functional.normalize(st.keys.float(), dim=-1)
        st.values.clone().add_(kn).sum()


def scaling(configs: dict, lengths: Sequence[int], *, reps: int = 3, ids_for=None, vocab=None, log=None,
            reference: bool = False, **shape) -> dict:
    """{name: {"lengths", "seconds" (median of reps), "slope", "cpu_seconds", "cpu_slope"}}; lengths
    interleaved per rep. The CPU-time slope is the steadier one on a loaded machine.

    ids_for: length -> [1, N] token ids (text-aware chunkers and guards need them), or None
    reference: also time ``reference_pass`` interleaved with the presets, under the name REFERENCE
    """
    times = {name: {n: [] for n in lengths} for name in configs}
    cpus = {name: {n: [] for n in lengths} for name in configs}
    cached = {n: synthetic_states(n, token_ids=None if ids_for is None else ids_for(n), vocab=vocab, **shape)
              for n in lengths}
    names = list(configs) + ([REFERENCE] if reference else [])
    if reference:
        times[REFERENCE], cpus[REFERENCE] = {n: [] for n in lengths}, {n: [] for n in lengths}
    for rep in range(reps):
        for n in lengths:
            for name in names:
                if name == REFERENCE:
                    with torch.inference_mode():
                        wall, cpu = time.perf_counter(), time.process_time()
                        reference_pass(cached[n])
                        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                else:
                    wall, cpu = compression_seconds(configs[name], cached[n], warmup=rep == 0)
                times[name][n].append(wall)
                cpus[name][n].append(cpu)
                if log:
                    log(f"rep {rep} N={n} {name}: {wall * 1e3:.1f} ms (cpu {cpu * 1e3:.1f} ms)")
    out = {}
    for name in names:
        med = [statistics.median(times[name][n]) for n in lengths]
        cpu_med = [statistics.median(cpus[name][n]) for n in lengths]
        out[name] = {"lengths": list(lengths), "seconds": med, "all_seconds": [times[name][n] for n in lengths],
                     "slope": loglog_slope(lengths, med), "cpu_seconds": cpu_med,
                     "all_cpu_seconds": [cpus[name][n] for n in lengths], "cpu_slope": loglog_slope(lengths, cpu_med)}
    return out
