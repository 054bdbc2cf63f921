"""How close a decode step comes to the machine's bandwidth floor (SmolLM2, one thread), and where
the rest of the step goes.

    python benchmarks/bench_decode_share.py --threads 1 [--length 8192] [--budget 0.25] [--rounds 10]

A decode step has to read every weight once and every KV slot the cache holds once, so no step
can be faster than (weight bytes + KV bytes held) / the bandwidth one thread streams. Measured
honestly, in one process, interleaved:

1. one prefill of the first ``--length`` tokens of the essays (the recorder, as the bench);
2. caches: plain transformers (the stock ``DynamicCache`` decoded by a hook-free twin of the
   model over the same weights, SDPA), kvcompress uncompressed, and each ``--presets`` at
   ``--budget``; plus the same model over a 16-token cache (``weights-only``: the step with
   almost no KV, i.e. what the model's own layers cost on this machine whatever the cache);
3. ``--rounds`` rounds: the bandwidth with the decode's thread count (``kvcompress.bench.
   bandwidth``: a float32 sum and a gemv over a 512 MiB buffer, best of 5), then one greedy
   step of every cache. A method's floor is its bytes over the round's bandwidth; the share is
   floor / TPOT, median over rounds (sum: the streaming floor; gemv: the floor at the speed a
   matrix-vector product reads a matrix);
4. a torch.profiler breakdown of two steps of the first preset: the weight matmuls (``mm`` /
   ``addmm``), attention (scaled_dot_product_attention), everything else (small ops, Python),
   and the bandwidth the weight matmuls reached.

Results: benchmarks/results/decode_share_smollm2_8k.json (machine and load averages included).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from kvcompress.bench import caches as C
from kvcompress.bench.bandwidth import floor_ms, measure_bandwidth
from kvcompress.bench.machine import describe_machine, load_average
from kvcompress.bench.sources import TokenSource, load, weight_bytes_per_token
from kvcompress.bench.timing import DecodeStream
from kvcompress.hf.generate import cache_kwarg
from kvcompress.presets import get_preset

RESULTS = Path(__file__).parent / "results"
TINY_CONTEXT = 16
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul")
ATTENTION_OPS = ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::scaled_dot_product_attention",
                 "aten::_scaled_dot_product_attention_math")


def breakdown(stream: DecodeStream, weight_bytes: int, steps: int = 2) -> dict:
    """ms per step: weight matmuls, attention, other ops, Python; the matmuls' bandwidth."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            stream.step()
        wall = (time.perf_counter() - start) / steps * 1e3
    self_ms: dict[str, float] = {}
    for e in prof.key_averages():
        self_ms[e.key] = self_ms.get(e.key, 0.0) + e.self_cpu_time_total / 1e3 / steps
    mm = sum(v for k, v in self_ms.items() if k in MATMUL_OPS)
    att = sum(v for k, v in self_ms.items() if k in ATTENTION_OPS)
    ops = sum(self_ms.values())
    top = sorted(self_ms.items(), key=lambda kv: -kv[1])[:12]
    return {"wall_ms": round(wall, 2), "weight_matmul_ms": round(mm, 2), "attention_ms": round(att, 2),
            "other_ops_ms": round(ops - mm - att, 2), "python_and_untraced_ms": round(max(wall - ops, 0.0), 2),
            "weight_matmul_gbps": round(weight_bytes / (mm * 1e-3) / 1e9, 3) if mm else None,
            "top_ops_ms": {k: round(v, 2) for k, v in top}}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--budget", type=float, default=0.25)
    ap.add_argument("--presets", nargs="+", default=["centroidkv", "semanticache"])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    return ap


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.length < TINY_CONTEXT + 1 or args.rounds < 1 or args.threads < 1 or not 0 < args.budget <= 1:
        ap.error(f"--length > {TINY_CONTEXT}, --rounds >= 1, --threads >= 1 and 0 < --budget <= 1")
    try:  # a bad preset name fails here, before the model loads
        configs = {p: get_preset(p, keep_ratio=args.budget, on_infeasible="best_effort") for p in args.presets}
    except ValueError as exc:
        ap.error(str(exc))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    machine = describe_machine()
    loaded = load("smollm2")
    model, key = loaded.model, cache_kwarg(loaded.model)
    plain = C.plain_twin(model)  # before any cache binds the model
    weights = weight_bytes_per_token(model)
    source = TokenSource(loaded.tokenizer, loaded.vocab, None, 0)
    ids = source.ids(args.length + 1)
    snap, prefill_s = C.prefill_snapshot(model, loaded.tokenizer, loaded.vocab, ids[:, :args.length],
                                         configs.values())
    tiny, _ = C.prefill_snapshot(model, loaded.tokenizer, loaded.vocab, ids[:, :TINY_CONTEXT], [])
    caches = {"plain transformers": (plain, C.stock_cache(model, snap), ids[:, args.length:]),
              "kvcompress uncompressed": (model, C.uncompressed_cache(model, snap, "sdpa"), ids[:, args.length:])}
    for name, cfg in configs.items():
        caches[f"{name} {args.budget}"] = (model, C.compressed_cache(model, snap, cfg, "sdpa").cache,
                                           ids[:, args.length:])
    caches["weights-only (plain, 16 tokens)"] = (plain, C.stock_cache(model, tiny), ids[:, TINY_CONTEXT:TINY_CONTEXT + 1])
    streams = {name: DecodeStream(runner, cache, first, key) for name, (runner, cache, first) in caches.items()}
    held = {name: C.kv_bytes(cache)["held"] for name, (_, cache, _) in caches.items()}
    for s in streams.values():  # warm-up
        s.step()
        s.step()
    rounds = []
    for r in range(args.rounds):
        bw = measure_bandwidth()
        rec = {"round": r, "load_average": load_average(), "sum_gbps": bw["sum_gbps"], "gemv_gbps": bw["gemv_gbps"],
               "step_ms": {}}
        for name, s in streams.items():
            rec["step_ms"][name] = round(s.step() * 1e3, 2)
        rounds.append(rec)
        print(f"round {r}: sum {bw['sum_gbps']} GB/s, gemv {bw['gemv_gbps']} GB/s, "
              + ", ".join(f"{n} {t:.0f} ms" for n, t in rec["step_ms"].items()), file=sys.stderr, flush=True)
    methods = {}
    for name in streams:
        nbytes = weights + held[name]
        sum_share = [floor_ms(nbytes, rd["sum_gbps"]) / rd["step_ms"][name] for rd in rounds]
        gemv_share = [floor_ms(nbytes, rd["gemv_gbps"]) / rd["step_ms"][name] for rd in rounds]
        methods[name] = {"kv_bytes_held": held[name], "bytes_read": nbytes,
                         "tpot_ms_median": statistics.median(rd["step_ms"][name] for rd in rounds),
                         "share_of_sum_floor": round(statistics.median(sum_share), 4),
                         "share_of_gemv_floor": round(statistics.median(gemv_share), 4)}
    first = f"{args.presets[0]} {args.budget}"
    doc = {"benchmark": "decode step against the bandwidth floor (one thread, interleaved)",
           "command": " ".join(["python"] + sys.argv), "machine": machine, "model": "smollm2",
           "length": args.length, "budget": args.budget, "threads": torch.get_num_threads(),
           "weights_bytes_per_token": weights, "prefill_s": round(prefill_s, 2),
           "bandwidth_gbps": {"sum_median": statistics.median(rd["sum_gbps"] for rd in rounds),
                              "gemv_median": statistics.median(rd["gemv_gbps"] for rd in rounds)},
           "methods": methods, "rounds": rounds,
           "breakdown": {first: breakdown(streams[first], weights),
                         "weights-only (plain, 16 tokens)": breakdown(streams["weights-only (plain, 16 tokens)"],
                                                                      weights)},
           "load_average_end": load_average()}
    out = args.out or RESULTS / f"decode_share_smollm2_{args.length // 1024}k.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    for name, m in methods.items():
        print(f"{name:34s} TPOT {m['tpot_ms_median']:7.1f} ms  share of floor: sum {m['share_of_sum_floor']:.1%}, "
              f"gemv {m['share_of_gemv_floor']:.1%}")
    print(json.dumps(doc["breakdown"], indent=1))
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
