"""Compression cost of every preset as a share of the plain prefill (SmolLM2 8k), and its growth
with N (synthetic Llama-3-8B-shaped keys, 2k..32k).

    python benchmarks/bench_cost.py --threads 1 --out benchmarks/results/cost_smollm2_8192.json
    python benchmarks/bench_cost.py --threads 1 --exclude fitted   # the fitted presets' fit left out
    python benchmarks/bench_cost.py --scaling --threads 1 --out benchmarks/results/cost_scaling.json
    python benchmarks/bench_cost.py --scaling --presets quadratic --lengths 1024 2048 4096 8192 \
        --out benchmarks/results/cost_scaling_quadratic.json
    python benchmarks/bench_cost.py --length 1024 --rounds 1 --presets semanticache   # smoke

1. One recorder prefill of the first N tokens of the Paul Graham essays gives every layer's keys,
   values and last 64 queries (what the scorers and the sentence guard read).
2. ``--rounds`` rounds, in one process: a plain transformers prefill (SDPA attention, the stock
   DynamicCache, no kvcompress code), then every preset prepares and compresses the 30 layers of the
   snapshot (kvcompress.bench.cost.compression_seconds). A preset's share is its compression time
   over that round's prefill; the median over rounds is reported; load averages per round.
3. ``--scaling``: one layer of 8 KV heads x 128 dims, N in --lengths, reps interleaved; the log-log
   slope of the median times (linear cost: slope ~1).
4. Presets that read the reconstruction statistic (kvzip*) compress random positive scores; the
   reconstruction pass itself (a model forward over the context, by design) is timed once per
   round beside the prefill and reported apart (``reconstruction``), not as compression.
   semanticache-global (GSC over a whole head, O(N^2) by design) is timed on one layer.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

# the checkout this script lives in, not whichever kvcompress the environment installed (an
# editable install of another worktree would otherwise be the code timed)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvcompress.bench import cost  # noqa: E402
from kvcompress.bench.machine import describe_machine, load_average  # noqa: E402

RESULTS = Path(__file__).parent / "results"
SKIP_DEFAULT = ("semanticache-global",)  # GSC over a whole head: O(N^2) by design (an ablation), timed on 1 layer
MAIN = ("semanticache", "semanticache-safe", "centroidkv", "centroidkv-safe", "streamingllm", "snapkv", "cam",
        "kvzip-gsc")
# all-pairs by design: D2O compares every evicted token with every kept one (E x K cosines), GSC
# over a whole head compares each seed with every later slot; their slope is measured, not bounded
QUADRATIC = ("d2o", "semanticache-global")


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def configs_for(names, keep: float) -> dict:
    from kvcompress.presets import get_preset

    return {n: get_preset(n, keep_ratio=keep, on_infeasible="best_effort") for n in names}


def run_cost(args) -> dict:
    from kvcompress.bench.caches import prefill_snapshot
    from kvcompress.bench.sources import TokenSource, load
    from kvcompress.bench.timing import plain_attention
    from kvcompress.presets import list_presets

    names = [p for p in list_presets() if p not in SKIP_DEFAULT and not any(x in p for x in args.exclude)] \
        if args.presets == ["all"] else args.presets
    configs = configs_for(names, args.keep)
    loaded = load("smollm2")
    model = loaded.model
    ids = TokenSource(loaded.tokenizer, loaded.vocab).ids(args.length)
    window = max([c.query_window for c in configs.values()] + [1])
    log(f"recorder prefill of {args.length} tokens (query window {window}) ...")
    snap, rec_s = prefill_snapshot(model, loaded.tokenizer, loaded.vocab, ids, [c.replace(track_attention=False)
                                                                              for c in configs.values()])

    def prefill() -> tuple[float, float]:
        with plain_attention(model), torch.inference_mode():
            start, cpu = time.perf_counter(), time.process_time()
            model.base_model(input_ids=ids, use_cache=True)
            return time.perf_counter() - start, time.process_time() - cpu

    doc = {"benchmark": "compression cost as a share of the plain prefill", "command": " ".join(sys.argv),
           "machine": describe_machine(), "model": "smollm2", "length": args.length, "keep_ratio": args.keep,
           "recorder_prefill_s": rec_s, "stats_note": cost.STATS_NOTE,
           "prefill": "model.base_model(ids) with attn_implementation='sdpa' and the stock DynamicCache"}
    doc.update(cost.cost_rounds(prefill, configs, snap.states, rounds=args.rounds, log=log))
    from kvcompress import Pipeline

    if args.reconstruction and any(Pipeline(c).needs.model_pass for c in configs.values()):
        rec = []
        for r, rnd in enumerate(doc["rounds"][:args.reconstruction]):
            with plain_attention(model), torch.inference_mode():
                secs = cost.reconstruction_seconds(model, loaded.tokenizer, snap.states, ids)
            rec.append({"round": r, "seconds": secs, "share_of_that_rounds_prefill": secs / rnd["prefill_s"]})
            log(f"reconstruction pass {secs:.1f} s = {secs / rnd['prefill_s']:.1%} of round {r}'s prefill")
        doc["reconstruction"] = {"note": "the model pass the kvzip presets need before compressing (a forward over "
                                         "the context and a repeat prompt), not counted as compression",
                                 "passes": rec}
    if args.presets == ["all"]:
        doc["single_layer"] = {}
        for name in SKIP_DEFAULT:
            cfg = configs_for([name], args.keep)[name]
            wall, _ = cost.compression_seconds(cfg, snap.states[:1], warmup=False)
            doc["single_layer"][name] = {"one_layer_s": wall, "layers": len(snap.states),
                                         "note": "one layer, not warmed up; x layers / prefill for the share"}
    if args.flop_bounds:
        doc["flop_bounds"] = flop_bounds(model.config, args.length, args.keep, doc["rounds"])
    doc["load_average_end"] = load_average()
    return doc


def flop_bounds(config, length: int, keep: float, rounds: list) -> dict:
    """The all-pairs presets' products alone against this run's prefill (kvcompress.bench.flops)."""
    from kvcompress.bench import flops
    import statistics

    kv_heads = config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    layers = config.num_hidden_layers
    pre = flops.prefill_flops(config, length)
    wall = statistics.median(r["prefill_s"] for r in rounds)
    cpu = statistics.median(r["prefill_cpu_s"] for r in rounds)
    out = {"note": flops.__doc__.strip().split("\n\n")[0], "prefill_flops": pre,
           "prefill_s_median": wall, "prefill_cpu_s_median": cpu,
           "prefill_gflops_per_cpu_s": pre["total"] / cpu / 1e9}
    for name, rec in (("d2o", flops.d2o_product(length, keep, heads=kv_heads, head_dim=head_dim, layers=layers)),
                      ("d2o float32", flops.d2o_product(length, keep, heads=kv_heads, head_dim=head_dim, layers=layers,
                                                        coarse=False)),
                      ("semanticache-global", flops.all_pairs_product(length, heads=kv_heads, head_dim=head_dim,
                                                                      layers=layers))):
        rec["share_of_prefill_flops"] = rec["flops"] / pre["total"]
        rec["share_of_prefill_cpu"] = rec["cpu_s"] / cpu
        out[name] = rec
        log(f"{name}: the product alone {rec['flops'] / 1e9:.0f} GFLOP = {rec['share_of_prefill_flops']:.2%} of the "
            f"prefill's FLOPs; {rec['cpu_s']:.2f} s cpu = {rec['share_of_prefill_cpu']:.2%} of the prefill's cpu time")
    return out


def run_scaling(args) -> dict:
    from kvcompress.bench.sources import TINY_VOCAB, TokenSource, _smollm2_tokenizer
    from kvcompress.hf.vocab import token_texts

    names = {"all": list(MAIN), "quadratic": list(QUADRATIC)}.get(args.presets[0], args.presets)
    tok = _smollm2_tokenizer()
    vocab = token_texts(tok) if tok is not None else TINY_VOCAB
    source = TokenSource(tok, vocab)
    doc = {"benchmark": "compression cost against N (one layer, synthetic Llama-3-8B-shaped keys: 8 KV heads, "
                        "head dim 128, 32 query heads)", "command": " ".join(sys.argv),
           "machine": describe_machine(), "keep_ratio": args.keep, "reps": args.reps}
    doc["presets"] = cost.scaling(configs_for(names, args.keep), args.lengths, reps=args.reps, ids_for=source.ids,
                                  vocab=vocab, log=log, reference=True)
    ref = doc["reference"] = doc["presets"].pop(cost.REFERENCE)
    ref["what"] = cost.reference_pass.__doc__.split("\n\n")[0].replace("\n", " ")
    for rec in doc["presets"].values():  # how much steeper than the machine's own slope for linear work
        rec["cpu_slope_over_reference"] = rec["cpu_slope"] - ref["cpu_slope"] + 1.0
        rec["cpu_slope_min"] = cost.loglog_slope(args.lengths, [min(x) for x in rec["all_cpu_seconds"]])
    ref["cpu_slope_min"] = cost.loglog_slope(args.lengths, [min(x) for x in ref["all_cpu_seconds"]])
    doc["load_averages"] = "load_average in machine (start) and load_average_end"
    doc["load_average_end"] = load_average()
    return doc


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scaling", action="store_true", help="cost against N on synthetic keys instead")
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 32768])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--keep", type=float, default=0.25)
    ap.add_argument("--presets", nargs="+", default=["all"])
    ap.add_argument("--exclude", nargs="+", default=[],
                    help="with --presets all: leave out presets whose name contains one of these (e.g. fitted)")
    ap.add_argument("--reconstruction", type=int, default=1,
                    help="reconstruction passes timed (kvzip presets; 0: skip)")
    ap.add_argument("--flop-bounds", type=int, default=1,
                    help="time the all-pairs products (D2O, whole-head GSC) alone against the prefill (0: skip)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    return ap


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if (args.length < 16 or args.rounds < 1 or args.reps < 1 or not 0 < args.keep < 1 or args.threads < 1
            or args.reconstruction < 0 or args.flop_bounds < 0):
        ap.error("--length >= 16, --rounds >= 1, --reps >= 1, 0 < --keep < 1, --threads >= 1, "
                 "--reconstruction >= 0 and --flop-bounds >= 0")
    from kvcompress.presets import list_presets

    unknown = [p for p in args.presets if p not in ("all", "quadratic") and p not in list_presets()]
    if unknown:  # before the model loads
        ap.error(f"unknown presets {unknown}: expected 'all' or names from kvcompress.list_presets()")
    torch.set_num_threads(args.threads)
    doc = run_scaling(args) if args.scaling else run_cost(args)
    out = args.out or RESULTS / ("cost_scaling.json" if args.scaling else f"cost_smollm2_{args.length}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    key, cpu_key = ("slope", "cpu_slope") if args.scaling else ("share_median", "cpu_share_median")
    for name, rec in doc["presets"].items():
        extra = f"  {cpu_key} {rec[cpu_key]:.4f}" if cpu_key in rec else ""
        print(f"{name:28s} {key} {rec[key]:.4f}{extra}")
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
