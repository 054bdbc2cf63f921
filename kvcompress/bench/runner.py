"""The efficiency benchmark: per model and context length, one prefill (or random keys/values),
then every method decodes from its own copy; TPOT, prefill / compression time, KV bytes, peak
memory, attention alone, compilations. Results go to a JSON file after every context, so an
interrupted run keeps what it measured.
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..validation import check_choice, check_int, check_range, require
from . import caches as C
from .bandwidth import floor_ms, measure_bandwidth
from .floors import FLOOR_BUDGET, evaluate
from .machine import describe_machine, load_average
from .memory import METHOD_DOC, PeakRSS, rss_bytes
from .sources import LLAMA3_SYNTHETIC, MODELS, SMOLLM2, LoadedModel, TokenSource, load, weight_bytes_per_token
from .timing import DecodeStream, attention_time, layer_tensors, round_robin, summarize

BACKENDS = ("sdpa", "flex")
DEFAULT_PRESETS = ("semanticache", "streamingllm", "centroidkv")


@dataclass
class BenchSettings:
    """What to measure. Lengths are context tokens in the cache when decoding starts.

    lengths:           for models that are prefilled (SmolLM2, tiny)
    synthetic_lengths: for the synthetic Llama-3-8B stack (random keys/values, no prefill)
    warmup:            untimed decode steps per cache before the timed ones (flex compiles there)
    stock:             also decode with transformers' DynamicCache through transformers' own SDPA
                       attention (a twin of the model over the same weights, no kvcompress code)
    bandwidth_bytes:   buffer streamed to measure the machine's bandwidth floor (0: skip)
    profile:           torch.profiler / cProfile summaries at each model's longest context
    """

    models: tuple = (SMOLLM2, LLAMA3_SYNTHETIC)
    lengths: tuple = (2048, 4096, 8192)
    synthetic_lengths: tuple = (8192, 16384, 32768)
    synthetic_layers: int = 2
    budgets: tuple = (0.5, 0.25, 0.2)
    presets: tuple = DEFAULT_PRESETS
    backends: tuple = BACKENDS
    decode_tokens: int = 16
    warmup: int = 2
    attention_reps: int = 5
    dtype: str = "float32"
    stock: bool = True
    bandwidth_bytes: int = 512 * 1024 * 1024
    on_infeasible: str = "best_effort"
    profile: bool = True
    text: str | None = None
    seed: int = 0
    threads: int | None = None
    progress: bool = True

    def __post_init__(self):
        for name in ("models", "lengths", "synthetic_lengths", "budgets", "presets", "backends"):
            value = getattr(self, name)
            require(isinstance(value, (list, tuple)) and len(value) > 0, name, value, "a non-empty list")
            setattr(self, name, tuple(value))
        for m in self.models:
            check_choice("models[]", m, MODELS)
        for b in self.backends:
            check_choice("backends[]", b, BACKENDS)
        for n in self.lengths + self.synthetic_lengths:
            check_int("lengths[]", n, 16)
        for b in self.budgets:
            check_range("budgets[]", b, 0.0, 1.0, lo_open=True, hi_open=True)
        from ..presets import list_presets

        names = list_presets()
        for p in self.presets:
            check_choice("presets[]", p, names)
        check_int("decode_tokens", self.decode_tokens, 1)
        check_int("warmup", self.warmup, 1)
        check_int("attention_reps", self.attention_reps, 1)
        check_int("synthetic_layers", self.synthetic_layers, 1)
        check_choice("on_infeasible", self.on_infeasible, ("error", "best_effort"))
        if self.threads is not None:
            check_int("threads", self.threads, 1)
        check_int("bandwidth_bytes", self.bandwidth_bytes, 0)


@dataclass
class _Variant:
    """One cache to decode with: a method (full-stock, full or a preset) at a budget and backend."""

    method: str
    budget: float | None
    backend: str
    cache: object
    build: dict = field(default_factory=dict)
    stream: DecodeStream | None = None
    decode_mem: dict = field(default_factory=dict)
    warmup_compiles: int = 0
    compress_steps_before: int = 0


def _bar(total, desc, enabled, leave=False):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, leave=leave, disable=not enabled, file=sys.stderr, dynamic_ncols=True)


def _lengths_for(loaded: LoadedModel, s: BenchSettings) -> tuple:
    return s.lengths if loaded.prefill else s.synthetic_lengths


class Benchmark:
    """Runs the settings, keeping ``results`` (the JSON document) up to date.

    out: path of the results JSON (written after each context), or None
    log: a function taking a line of text (progress notes besides the bars)
    """

    def __init__(self, settings: BenchSettings, out: Path | None = None, log=None, command: str | None = None):
        self.s = settings
        self.out = None if out is None else Path(out)
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self._plain: dict = {}  # model name -> its twin running plain transformers attention
        self.results = {
            "benchmark": "kvcompress efficiency: decode speed, memory and compression cost",
            "command": command,
            "settings": asdict(settings),
            "machine": None,
            "memory_method": " ".join(METHOD_DOC.split()),
            "timing_method": ("TPOT: median of the timed greedy decode steps through the whole model (lm_head "
                              "included), caches stepped round robin; attention alone: every layer's decode "
                              "attention (L=1) over the cache as held, min/median of reps after a warm-up"),
            "baseline_method": ("full-stock = plain transformers: the stock DynamicCache decoded by a twin of "
                                "the model over the same weights with attn_implementation='sdpa' and no hooks "
                                "(no kvcompress code in the path); tpot_vs_plain = per round, the plain step's "
                                "time over this method's step of the same round, median over rounds"),
            "floor_method": ("bandwidth floor: (weights read per token + KV bytes held) / the bandwidth measured "
                             "in the same context (kvcompress.bench.bandwidth, the faster of a sum and a gemv "
                             "over a buffer far larger than the caches); share_of_floor = floor / TPOT"),
            "models": {},
            "contexts": [],
            "runs": [],
            "floors": [],
            "profiles": {},
        }

    # ------------------------------------------------------------------ top level
    def run(self) -> dict:
        s = self.s
        if s.threads is not None:
            torch.set_num_threads(s.threads)
        self.results["machine"] = describe_machine()
        load = self.results["machine"]["load_average"]
        cores = self.results["machine"]["cores"] or 1
        if load and load[0] > cores and torch.get_num_threads() > 1:
            self.log(f"note: load average {load[0]} > {cores} cores; --threads 1 gives steadier timings")
        started = time.perf_counter()
        tokenizer = None
        for name in s.models:
            loaded = self._load(name, tokenizer)
            tokenizer = tokenizer or loaded.tokenizer
            lengths = _lengths_for(loaded, s)
            source = TokenSource(loaded.tokenizer, loaded.vocab, s.text, s.seed)
            for length in lengths:
                self._context(loaded, source, length, profile=s.profile and length == max(lengths))
                self._finish(time.perf_counter() - started)
            del loaded
            gc.collect()
        self._finish(time.perf_counter() - started, final=True)
        return self.results

    def _load(self, name: str, tokenizer) -> LoadedModel:
        self.log(f"loading {name} ...")
        with PeakRSS() as mem:
            loaded = load(name, dtype=self.s.dtype, synthetic_layers=self.s.synthetic_layers, tokenizer=tokenizer,
                          seed=self.s.seed)
        from ..hf.support import ModelGeometry

        geo = ModelGeometry.of(loaded.model)
        if self.s.stock:
            self._plain[name] = C.plain_twin(loaded.model)  # before any cache binds (and hooks) the model
        self.results["models"][name] = {
            "description": loaded.description, "geometry": asdict(geo), "dtype": self.s.dtype,
            "parameters": sum(p.numel() for p in loaded.model.parameters()),
            "weights_bytes_per_token": weight_bytes_per_token(loaded.model),
            "load_s": round(loaded.load_s, 2), "load_rss_delta": mem.delta,
            "contexts": "model prefill" if loaded.prefill else
                        "random keys/values (prototypes + noise) over real token ids: no model prefill",
        }
        return loaded

    def _finish(self, elapsed: float, final: bool = False) -> None:
        r = self.results
        weights = {m: info["weights_bytes_per_token"] for m, info in r["models"].items()}
        r["floors"] = evaluate(r["runs"], r["contexts"], weights)
        r["elapsed_s"] = round(elapsed, 1)
        r["load_average_end"] = load_average()
        r["complete"] = final
        if self.out is not None:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.out.with_suffix(".tmp")
            tmp.write_text(json.dumps(r, indent=1) + "\n")
            tmp.replace(self.out)

    # ------------------------------------------------------------------ one context
    def _configs(self):
        from ..presets import get_preset

        return {(p, b): get_preset(p, keep_ratio=b, on_infeasible=self.s.on_infeasible)
                for p in self.s.presets for b in self.s.budgets}

    def _context(self, loaded: LoadedModel, source: TokenSource, length: int, profile: bool) -> None:
        s, model = self.s, loaded.model
        from ..hf.generate import cache_kwarg

        key = cache_kwarg(model)
        configs = self._configs()
        ids = source.ids(length + 1)  # the cache holds `length` tokens; decoding starts at the next
        context = {"model": loaded.name, "length": length, "load_average_start": load_average(),
                   "source": "prefill" if loaded.prefill else "random"}
        if s.bandwidth_bytes:
            context["bandwidth_start"] = measure_bandwidth(s.bandwidth_bytes)
        self.log(f"{loaded.name} @ {length} tokens: {'prefill' if loaded.prefill else 'random keys/values'} ...")
        with PeakRSS() as mem:
            if loaded.prefill:
                snap, context["prefill_s"] = C.prefill_snapshot(model, loaded.tokenizer, loaded.vocab, ids[:, :length],
                                                                configs.values())
            else:
                from ..eval.caches import needs_of

                window, _ = needs_of(configs.values())
                snap = C.random_snapshot(model, ids[:, :length], loaded.vocab, seed=s.seed, query_window=window)
                context["prefill_s"] = None
        context["prefill_rss_delta"] = mem.delta
        first = ids[:, length:]
        variants = self._build(model, snap, configs, loaded.name, length, loaded.tokenizer)
        self._warm(variants, model, first, key, loaded.name)
        bar = _bar(s.decode_tokens, f"{loaded.name}@{length} decode x{len(variants)}", s.progress)
        try:
            context["round_load_average"] = round_robin([v.stream for v in variants], s.decode_tokens, bar)
        finally:
            bar.close()
        attention = self._attention(variants, snap.geometry.num_q_heads)
        context["load_average_end"] = load_average()
        if s.bandwidth_bytes:
            context["bandwidth_end"] = measure_bandwidth(s.bandwidth_bytes)
            context["bandwidth_gbps"] = max(context["bandwidth_start"]["gbps"], context["bandwidth_end"]["gbps"])
        plain = next((v for v in variants if v.method == "full-stock"), None)
        weights = self.results["models"][loaded.name]["weights_bytes_per_token"]
        context["rss_end"] = rss_bytes()
        records = [self._record(v, loaded.name, length, attention) for v in variants]
        for v, rec in zip(variants, records):
            rec.update(_against_plain(v, plain, weights, context.get("bandwidth_gbps")))
        if profile:
            self._profile(variants, snap, configs, loaded.name, length)
        self.results["contexts"].append(context)
        self.results["runs"].extend(records)
        for v in variants:
            C.release(v.cache)
        del variants, snap
        gc.collect()

    def _build(self, model, snap, configs, name: str, length: int, tokenizer=None) -> list[_Variant]:
        s = self.s
        out: list[_Variant] = []
        total = int(s.stock) + len(configs) + 1
        bar = _bar(total, f"{name}@{length} build", s.progress)

        def clones(first: _Variant):
            out.append(first)
            for backend in s.backends[1:]:
                with PeakRSS() as mem:
                    twin = C.clone_cache(first.cache, model, backend)
                build = dict(first.build, cloned_from=first.backend, clone_rss_delta=mem.delta)
                out.append(_Variant(first.method, first.budget, backend, twin, build))

        def sized(v: _Variant) -> _Variant:
            v.build["kv"] = C.kv_bytes(v.cache)  # right after compression, before any decode step
            v.build["slots"] = C.slots(v.cache)
            return v

        try:
            if s.stock:
                with PeakRSS() as mem:
                    cache, secs = C.timed(lambda: C.stock_cache(model, snap))
                out.append(sized(_Variant("full-stock", None, "stock-sdpa", cache,
                                          {"copy_s": secs, "compress_s": 0.0, "rss_delta": mem.delta})))
                bar.update(1)
            with PeakRSS() as mem:
                cache, secs = C.timed(lambda: C.uncompressed_cache(model, snap, s.backends[0]))
            clones(sized(_Variant("full", None, s.backends[0], cache, {"copy_s": secs, "compress_s": 0.0,
                                                                        "rss_delta": mem.delta})))
            bar.update(1)
            for (preset, budget), cfg in configs.items():
                bar.set_postfix_str(f"{preset} {budget}")
                with PeakRSS() as mem:
                    built = C.compressed_cache(model, snap, cfg, s.backends[0], tokenizer)
                build = {"copy_s": built.copy_s, "compress_s": built.compress_s, "budget_met": built.budget_met,
                         "keep_mean": built.keep_mean, "keep_max": built.keep_max, "rss_delta": mem.delta,
                         "reconstruct_s": built.reconstruct_s}
                clones(sized(_Variant(preset, budget, s.backends[0], built.cache, build)))
                bar.update(1)
        finally:
            bar.close()
        return out

    def _warm(self, variants: list[_Variant], model, first, key, name: str | None = None) -> None:
        s = self.s
        bar = _bar(len(variants), "warm-up (flex compiles here)", s.progress)
        try:
            for v in variants:
                runner = self._plain.get(name, model) if v.method == "full-stock" else model
                v.stream = DecodeStream(runner, v.cache, first, key)
                for _ in range(s.warmup - 1):
                    v.stream.step()
                with PeakRSS() as mem:
                    v.stream.step()  # the last warm-up step: its peak is the decode step's memory
                v.decode_mem = mem.as_dict()
                v.warmup_compiles = v.stream.compiles
                v.stream.compiles = 0
                v.compress_steps_before = v.stream.decode_compressions()
                bar.update(1)
        finally:
            bar.close()

    def _attention(self, variants: list[_Variant], num_q_heads: int) -> dict:
        """{(method, budget, backend): attention_time} over each distinct cache state."""
        out = {}
        done = set()
        for v in variants:
            state_key = (v.method, v.budget)
            if state_key in done:
                continue
            done.add(state_key)
            layers = layer_tensors(v.cache)
            backends = ("stock",) if v.method == "full-stock" else self.s.backends
            for backend in backends:
                out[(v.method, v.budget, backend)] = attention_time(layers, num_q_heads, backend,
                                                                    reps=self.s.attention_reps, seed=self.s.seed)
        return out

    def _record(self, v: _Variant, model: str, length: int, attention: dict) -> dict:
        sizes = v.build["kv"]
        end = C.kv_bytes(v.cache)
        att_backend = "stock" if v.method == "full-stock" else v.backend
        rec = {
            "model": model, "length": length, "method": v.method, "budget": v.budget, "backend": v.backend,
            "kv_bytes_full": sizes["full"], "kv_bytes_held": sizes["held"], "kv_bytes_allocated": sizes["allocated"],
            "tpot": summarize(v.stream.times),
            "compress_s": v.build.get("compress_s", 0.0), "copy_s": v.build.get("copy_s"),
            # the model pass a question-free importance preset runs before compressing (a forward
            # over the context, by design): apart from compress_s; None for the other methods
            "reconstruct_s": v.build.get("reconstruct_s"),
            "budget_met": v.build.get("budget_met"), "keep_mean": v.build.get("keep_mean"),
            "keep_max": v.build.get("keep_max"),
            "build_rss_delta": v.build.get("rss_delta", v.build.get("clone_rss_delta")),
            "decode_step_rss": v.decode_mem,
            "compiles_warmup": v.warmup_compiles, "compiles_timed": v.stream.compiles,
            "decode_compressions": v.stream.decode_compressions() - v.compress_steps_before,
            "attention": attention.get((v.method, v.budget, att_backend), {}),
            "kv_bytes_held_end": end["held"], "kv_bytes_allocated_end": end["allocated"],
            "slots": v.build["slots"], "slots_end": C.slots(v.cache),
        }
        if "cloned_from" in v.build:
            rec["cloned_from"] = v.build["cloned_from"]
        if sizes["full"]:
            rec["kv_held_ratio"] = round(sizes["held"] / sizes["full"], 4)
            rec["kv_allocated_ratio"] = round(sizes["allocated"] / sizes["full"], 4)
        return rec

    # ------------------------------------------------------------------ profiles
    def _profile(self, variants: list[_Variant], snap, configs, name: str, length: int) -> None:
        from .profiling import profile_compression, profile_decode

        self.log(f"profiling {name} @ {length} ...")
        budget = min(self.s.budgets, key=lambda b: abs(b - FLOOR_BUDGET))
        prof = {"length": length, "budget": budget, "decode": {}, "compression": {}}
        for v in variants:
            if v.method in ("full-stock", "full", self.s.presets[0]) and v.budget in (None, budget):
                prof["decode"][f"{v.method}/{v.backend}"] = profile_decode(v.stream)
        for preset in self.s.presets:
            prof["compression"][preset] = profile_compression(configs[(preset, budget)], snap.states[0], 0)
        self.results["profiles"][name] = prof


def _against_plain(v: _Variant, plain: _Variant | None, weights: int, gbps: float | None) -> dict:
    """This method's TPOT against plain transformers, round by round, and against the bandwidth floor."""
    out: dict = {}
    if plain is not None and v.stream.times and plain.stream.times:
        ratios = [p / t for p, t in zip(plain.stream.times, v.stream.times) if t > 0]
        out["tpot_vs_plain"] = {"median": round(statistics.median(ratios), 4),
                                "per_round": [round(x, 4) for x in ratios]}
    if gbps and v.stream.times:
        kv = v.build["kv"]["held"]
        floor = floor_ms(weights + kv, gbps)
        tpot = statistics.median(v.stream.times) * 1e3
        out["bandwidth_floor"] = {"gbps": gbps, "bytes_read": weights + kv, "floor_ms": _sig(floor),
                                  "share_of_floor": _sig(floor / tpot)}
    return out


def _sig(x: float, digits: int = 6) -> float:
    # significant digits, not decimals: a tiny model's floor is a few microseconds
    return float(f"{x:.{digits}g}")


def run_bench(settings: BenchSettings, out: Path | None = None, log=None, command: str | None = None) -> dict:
    """Run the benchmark; returns the results document (also written to ``out``)."""
    return Benchmark(settings, out, log, command).run()


def merge_results(documents: list[dict]) -> dict:
    """One results document from several runs (e.g. one per model): runs, contexts, models and
    profiles concatenated, floors re-evaluated (each floor still compares cells of one run),
    every run's command, settings, machine and load averages kept under ``parts``."""
    require(len(documents) > 0, "documents", documents, "at least one results document")
    merged = {k: v for k, v in documents[0].items() if k not in ("runs", "contexts", "models", "profiles")}
    merged.update(runs=[], contexts=[], models={}, profiles={}, parts=[])
    for doc in documents:
        merged["runs"].extend(doc.get("runs", []))
        merged["contexts"].extend(doc.get("contexts", []))
        merged["models"].update(doc.get("models", {}))
        merged["profiles"].update(doc.get("profiles", {}))
        merged["parts"].append({k: doc.get(k) for k in ("command", "settings", "machine", "elapsed_s",
                                                         "load_average_end", "complete")})
    weights = {m: info["weights_bytes_per_token"] for m, info in merged["models"].items()}
    merged["floors"] = evaluate(merged["runs"], merged["contexts"], weights)
    merged["complete"] = all(doc.get("complete") for doc in documents)
    merged["command"] = [doc.get("command") for doc in documents]
    merged["elapsed_s"] = sum(doc.get("elapsed_s") or 0 for doc in documents)
    return merged
