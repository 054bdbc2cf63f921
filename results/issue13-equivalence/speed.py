"""Decode TPOT and compression time, before (471d008) vs after, as ratios of interleaved runs.

    python speed.py --base /work/wt/h13-base --new /work/wt/h13 --rounds 3 --out speed.json

Each round runs one subprocess per tree (order alternating between rounds), each in its own
worktree so that tree's kvcompress is imported. A subprocess (``--worker``) loads SmolLM2, and
per method prefills the same 1k-token essay prompt into a fresh ``CompressedCache`` (sdpa, one
thread), reads the compression time the cache recorded, then decodes greedily, timing each
step after 2 untimed ones. Ratios new / base are taken per round (same load) and their median
reported, with the load average before and after each subprocess.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

METHODS = ("full", "semanticache", "centroidkv", "semanticache-safe")
TOKENS, KEEP, WARMUP, STEPS = 1024, 0.25, 2, 16
ESSAY_DIR = "/work/shared/data/paul_graham_essays"


def worker() -> dict:
    import torch

    torch.set_num_threads(1)
    from kvcompress.hf import CompressedCache
    from kvcompress.hf.generate import cache_kwarg
    from kvcompress.hf.loading import load_model

    import kvcompress

    model, tok = load_model()
    text = "\n\n".join(open(os.path.join(ESSAY_DIR, f)).read() for f in sorted(os.listdir(ESSAY_DIR))[:6])
    ids = tok(text, return_tensors="pt").input_ids[:, :TOKENS]
    kw = cache_kwarg(model)
    out = {}
    for method in METHODS:
        pipeline = None if method == "full" else method
        extra = {} if pipeline is None else {"keep_ratio": KEEP, "on_infeasible": "best_effort"}
        cache = CompressedCache.for_model(model, tok, pipeline, backend="sdpa", **extra)
        with torch.inference_mode():
            t0 = time.perf_counter()
            logits = model(input_ids=ids, use_cache=True, **{kw: cache}).logits[:, -1]
            prefill_s = time.perf_counter() - t0
            nxt = logits.argmax(-1, keepdim=True)
            steps = []
            for i in range(WARMUP + STEPS):
                t0 = time.perf_counter()
                logits = model(input_ids=nxt, use_cache=True, **{kw: cache}).logits[:, -1]
                nxt = logits.argmax(-1, keepdim=True)
                if i >= WARMUP:
                    steps.append(time.perf_counter() - t0)
        out[method] = {"prefill_s": prefill_s, "compress_s": cache.stats["compress_s"],
                       "prefill_compressions": cache.stats["prefill_compressions"],
                       "tpot_s": statistics.median(steps), "slots_per_layer": cache.slots_per_layer()[:1]}
        cache.close()
    out["kvcompress_file"] = kvcompress.__file__
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--base")
    ap.add_argument("--new")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="speed.json")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker()))
        return
    here = os.path.abspath(os.path.dirname(__file__))
    trees = {"base": args.base, "new": args.new}
    runs = []
    for r in range(args.rounds):
        order = ("base", "new") if r % 2 == 0 else ("new", "base")
        for name in order:
            load_before = os.getloadavg()
            # PYTHONPATH: the tree's kvcompress, not the script directory's nor the venv's editable one
            proc = subprocess.run([sys.executable, os.path.join(here, "speed.py"), "--worker"], cwd=trees[name],
                                  capture_output=True, text=True,
                                  env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": trees[name]})
            if proc.returncode:
                sys.exit(proc.stderr)
            runs.append({"round": r, "tree": name, "load_before": load_before, "load_after": os.getloadavg(),
                         "methods": json.loads(proc.stdout.strip().splitlines()[-1])})
            print(name, r, runs[-1]["methods"], flush=True)
    ratios = {}
    for r in runs:
        tree = os.path.realpath(trees[r["tree"]])
        assert os.path.realpath(r["methods"]["kvcompress_file"]).startswith(tree + os.sep), (r["tree"], tree)
    for method in METHODS:
        per_round = {"tpot": [], "compress": []}
        for r in range(args.rounds):
            b, n = ([x["methods"][method] for x in runs if x["round"] == r and x["tree"] == t] [0]
                    for t in ("base", "new"))
            per_round["tpot"].append(n["tpot_s"] / b["tpot_s"])
            if b["compress_s"] > 0:
                per_round["compress"].append(n["compress_s"] / b["compress_s"])
        ratios[method] = {k: {"per_round": v, "median": statistics.median(v)} for k, v in per_round.items() if v}
    result = {"what": "new/base ratios (< 1: the new code is faster), SmolLM2-135M float32, 1 thread, sdpa, "
                      f"{TOKENS}-token Paul Graham prompt, keep {KEEP}, {STEPS} timed decode steps after {WARMUP}",
              "machine": {"cpus": os.cpu_count(), "uname": " ".join(os.uname())},
              "trees": trees, "ratios": ratios, "runs": runs}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
