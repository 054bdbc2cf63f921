"""D2O's nearest-kept search: bfloat16 against float32, in one process, interleaved, CPU time.

    python benchmarks/bench_d2o_coarse.py --out benchmarks/results/d2o_coarse.json

1. The product alone at SmolLM2's 8k shapes (3 KV heads x 64, keep 0.25: [6144, 64] x [64, 2048]
   per head, 30 layers; ``kvcompress.bench.flops.d2o_product`` in float32 and in bfloat16), ``--reps``
   alternating.
2. The whole search (``most_similar_kept``, coarse=True against coarse=False) on synthetic
   Llama-3-8B-shaped keys of one layer (``--kv-heads`` heads x 128, keys around 64 prototypes plus
   noise, as ``bench_cost.py --scaling``), keep 0.25 with random kept slots, at each ``--lengths``:
   CPU seconds (min of ``--reps``, alternating), whether both return the same parents and
   similarities bit for bit, and the log-log slope of each against N (quadratic by definition:
   E x K = 0.1875 N^2 products).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def synthetic(N: int, heads: int, dim: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    protos = torch.randn(heads, 64, dim, generator=gen)
    pick = torch.randint(0, 64, (heads, N), generator=gen)
    keys = (protos.gather(1, pick[..., None].expand(heads, N, dim)) + 0.5 * torch.randn(heads, N, dim, generator=gen))[None]
    keep = torch.zeros(1, heads, N, dtype=torch.bool)
    keep.scatter_(-1, torch.rand(1, heads, N, generator=gen).topk(round(0.25 * N), -1).indices, True)
    return keys, ~keep, keep, torch.zeros(1, heads, N, dtype=torch.long)


def slope(xs, ys) -> float:
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from kvcompress.bench import flops
    from kvcompress.bench.machine import describe_machine, load_average
    from kvcompress.strategies import d2o

    doc = {"benchmark": "D2O nearest-kept search, bfloat16 coarse search against float32", "command": " ".join(sys.argv),
           "machine": describe_machine(), "coarse_available": d2o.coarse_available(torch.device("cpu")),
           "load_average_start": load_average()}
    prod = {"float32": [], "bfloat16": []}
    for r in range(args.reps):
        for coarse in ((False, True) if r % 2 == 0 else (True, False)):
            rec = flops.d2o_product(8192, 0.25, heads=3, head_dim=64, layers=30, reps=1, coarse=coarse)
            prod[rec["dtype"]].append(rec["cpu_s"])
    doc["product_smollm2_8k"] = {k: {"cpu_s_min": min(v), "cpu_s": v} for k, v in prod.items()}
    doc["product_smollm2_8k"]["bfloat16_over_float32"] = min(prod["bfloat16"]) / min(prod["float32"])
    print(f"product at 8k (30 layers): float32 {min(prod['float32']):.2f} s, bfloat16 {min(prod['bfloat16']):.2f} s "
          f"cpu", flush=True)
    rows = []
    with torch.inference_mode():
        for N in args.lengths:
            case = synthetic(N, args.kv_heads, 128)
            times = {True: [], False: []}
            outs = {}
            for r in range(args.reps):
                for coarse in ((False, True) if r % 2 == 0 else (True, False)):
                    start = time.process_time()
                    outs[coarse] = d2o.most_similar_kept(*case, coarse=coarse)
                    times[coarse].append(time.process_time() - start)
            same = torch.equal(outs[True][0], outs[False][0]) and torch.equal(outs[True][1], outs[False][1])
            row = {"length": N, "coarse_cpu_s": min(times[True]), "float32_cpu_s": min(times[False]),
                   "coarse_over_float32": min(times[True]) / min(times[False]), "identical": same,
                   "load_average": load_average()}
            rows.append(row)
            print(json.dumps(row), flush=True)
            del case, outs
    doc["search_llama_shaped"] = {"kv_heads": args.kv_heads, "head_dim": 128, "keep_ratio": 0.25, "rows": rows}
    if len(rows) > 1:
        Ns = [r["length"] for r in rows]
        doc["search_llama_shaped"]["slope_coarse"] = slope(Ns, [r["coarse_cpu_s"] for r in rows])
        doc["search_llama_shaped"]["slope_float32"] = slope(Ns, [r["float32_cpu_s"] for r in rows])
    doc["load_average_end"] = load_average()
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
