"""python benchmarks/bench_prefill_overhead.py --length 2048 --reps 2 --threads 1

Plain SDPA prefill (twin) vs the same prefill through a CompressedCache (no pipeline / a pipeline),
interleaved; then a torch.profiler top-ops table of each."""
import sys, time, statistics, torch
torch.set_num_threads(1)
from kvcompress.bench.sources import TokenSource, load
from kvcompress.bench.caches import plain_twin
from kvcompress.hf import CompressedCache
from kvcompress.hf.generate import cache_kwarg
from kvcompress.presets import get_preset
from kvcompress.protocols import Needs
from torch.profiler import profile, ProfilerActivity
import argparse, json
ap = argparse.ArgumentParser(description="plain SDPA prefill vs the same prefill through a kvcompress cache, interleaved")
ap.add_argument("--length", type=int, default=2048)
ap.add_argument("--reps", type=int, default=3)
ap.add_argument("--threads", type=int, default=1)
ap.add_argument("--out", default=None)
args = ap.parse_args()
torch.set_num_threads(args.threads)
N, reps = args.length, args.reps
loaded = load("smollm2"); model = loaded.model; tok = loaded.tokenizer
twin = plain_twin(model)
ids = TokenSource(tok, loaded.vocab).ids(N)
def plain():
    with torch.inference_mode():
        twin.base_model(input_ids=ids, use_cache=True)
def kvc(pipeline=None, record=None):
    def run():
        cache = CompressedCache.for_model(model, tok, pipeline, record=record)
        try:
            with torch.inference_mode():
                model.base_model(input_ids=ids, use_cache=True, **{cache_kwarg(model.base_model): cache})
        finally:
            cache.close()
    return run
variants = {"plain-sdpa": plain, "kvcompress-none": kvc(), "kvcompress-record-q64": kvc(record=Needs(query_window=64)),
            "kvcompress-streamingllm": kvc(get_preset("streamingllm", keep_ratio=0.25))}
times = {k: [] for k in variants}
for r in range(reps):
    for k, f in variants.items():
        t = time.perf_counter(); f(); times[k].append(time.perf_counter() - t)
        print(r, k, round(times[k][-1], 2), flush=True)
base = statistics.median(times["plain-sdpa"])
for k, v in times.items():
    print(f"{k:28s} median {statistics.median(v):.2f} s  ratio {statistics.median(v)/base:.3f}")
for k in ("plain-sdpa", "kvcompress-none"):
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        variants[k]()
    print(k); print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))
if args.out:
    with open(args.out, "w") as f:
        json.dump({"length": N, "reps": reps, "seconds": times, "ratio_to_plain":
                   {k: statistics.median(v) / base for k, v in times.items()}}, f, indent=1)
