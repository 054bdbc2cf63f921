"""Decode-step (L = 1) proportional attention on CPU: FlexAttention (compiled) vs SDPA.

Shapes: SmolLM2-135M (9 query heads, 3 KV heads, head dim 64) and Llama-3-8B (32 / 8 / 128),
one layer, batch 1, N = 2k / 8k / 32k slots, random keys and log-sizes. Also simulates a
1,000-token generation (a prefill, then N growing by one per step) and counts the graphs
torch.compile built. Writes JSON with the machine described; numbers on a shared machine are
noisy: the load average before and after is recorded, and ``min_ms`` is the least disturbed.

    python benchmarks/bench_attention_cpu.py [--quick] [--threads T] [--dtype D] [--out PATH]

The generation simulation always runs in float32; --dtype applies to the decode cases.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from kvcompress import flex
from kvcompress.bench.machine import describe_machine, load_average

SHAPES = {"smollm2-135m": (9, 3, 64), "llama-3-8b": (32, 8, 128)}
SLOTS = (2048, 8192, 32768)


def timed(fn, reps: int) -> dict:
    t0 = time.perf_counter()
    fn()  # first call: compiles flex for a new graph
    first = time.perf_counter() - t0
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return {"first_call_s": round(first, 3), "median_ms": round(statistics.median(ts) * 1e3, 4),
            "min_ms": round(min(ts) * 1e3, 4), "reps": reps}


def decode_case(name: str, n: int, reps: int, dtype: torch.dtype) -> dict:
    hq, hkv, d = SHAPES[name]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, hq, 1, d, generator=g).to(dtype)
    k = torch.randn(1, hkv, n, d, generator=g).to(dtype)
    v = torch.randn(1, hkv, n, d, generator=g).to(dtype)
    ls = torch.rand(1, hkv, n, generator=g).log1p()  # sizes in (1, 2), float32
    c0 = flex.compile_count()
    fx = timed(lambda: flex.flex_proportional_attention(q, k, v, ls), reps)
    fx["compiles"] = flex.compile_count() - c0
    sd = timed(lambda: flex.sdpa_proportional_attention(q, k, v, ls), reps)
    err = (flex.flex_proportional_attention(q, k, v, ls).float()
           - flex.sdpa_proportional_attention(q, k, v, ls).float()).abs().max().item()
    return {"model": name, "q_heads": hq, "kv_heads": hkv, "head_dim": d, "slots": n,
            "dtype": str(dtype).removeprefix("torch."), "flex": fx, "sdpa": sd,
            "faster": "flex" if fx["min_ms"] < sd["min_ms"] else "sdpa",
            "flex_over_sdpa_min": round(fx["min_ms"] / sd["min_ms"], 3), "max_abs_diff": err}


def generation_compiles(name: str, prompt: int, steps: int) -> dict:
    """One prefill of ``prompt`` tokens, then ``steps`` decode steps, counting compiles.

    The cache grows by concatenation each step, as transformers' DynamicLayer does, so every
    call gets contiguous tensors with one more slot.
    """
    hq, hkv, d = SHAPES[name]
    g = torch.Generator().manual_seed(1)
    k = torch.randn(1, hkv, prompt, d, generator=g)
    v = torch.randn(1, hkv, prompt, d, generator=g)
    ls = torch.zeros(1, hkv, prompt)
    c0 = flex.compile_count()
    t0 = time.perf_counter()
    flex.flex_proportional_attention(torch.randn(1, hq, prompt, d, generator=g), k, v, ls)
    prefill_compiles, prefill_s = flex.compile_count() - c0, time.perf_counter() - t0
    q = torch.randn(1, hq, 1, d, generator=g)
    t0 = time.perf_counter()
    for _ in range(steps):
        k = torch.cat([k, torch.randn(1, hkv, 1, d, generator=g)], dim=2)
        v = torch.cat([v, torch.randn(1, hkv, 1, d, generator=g)], dim=2)
        ls = torch.cat([ls, torch.zeros(1, hkv, 1)], dim=2)
        flex.flex_proportional_attention(q, k, v, ls)
    return {"model": name, "prompt_tokens": prompt, "decode_steps": steps,
            "compiles_prefill": prefill_compiles,
            "compiles_decode": flex.compile_count() - c0 - prefill_compiles,
            "compiles_total": flex.compile_count() - c0,
            "prefill_s_incl_compile": round(prefill_s, 2),
            "decode_s_incl_compile": round(time.perf_counter() - t0, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="N = 2k only, fewer repeats")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "attention_cpu.json"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    slots = SLOTS[:1] if args.quick else SLOTS
    reps = args.reps or (5 if args.quick else 15)
    info = describe_machine()
    generation = generation_compiles("smollm2-135m", prompt=1000, steps=1000)
    print(json.dumps(generation), flush=True)
    cases = []
    for name in SHAPES:
        for n in slots:
            cases.append(decode_case(name, n, reps, dtype))
            c = cases[-1]
            print(f"{name:13s} N={n:6d} flex {c['flex']['min_ms']:9.3f} ms  sdpa {c['sdpa']['min_ms']:9.3f} ms"
                  f"  (min of {reps}; medians {c['flex']['median_ms']:.3f} / {c['sdpa']['median_ms']:.3f})",
                  flush=True)
    info["load_average_after"] = load_average()
    result = {"benchmark": "decode attention, L=1, batch 1, one layer", "machine": info,
              "generation_compiles": generation, "cases": cases,
              "flex_compiles_total": flex.compile_count()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
