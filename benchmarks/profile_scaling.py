"""Per-token op time of one preset at two lengths (one synthetic Llama-3-8B-shaped layer, as in
``bench_cost.py --scaling``), to see which op makes a log-log slope exceed 1.

    python benchmarks/profile_scaling.py centroidkv 16384,32768 [--out FILE]

Prints, per torch op, self CPU microseconds per token at both lengths and their ratio; with
``--out`` appends the totals to a JSON list (machine load included).
"""

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.profiler import profile

from kvcompress.bench import cost
from kvcompress.bench.machine import load_average
from kvcompress.bench.sources import TokenSource, _smollm2_tokenizer
from kvcompress.hf.vocab import token_texts
from kvcompress.presets import get_preset


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("preset")
    ap.add_argument("lengths", help="two comma-separated lengths")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    tok = _smollm2_tokenizer()
    vocab = token_texts(tok)
    src = TokenSource(tok, vocab)
    lengths = [int(x) for x in args.lengths.split(",")]
    cfg = get_preset(args.preset, keep_ratio=0.25, on_infeasible="best_effort")
    res = {}
    for n in lengths:
        st = cost.synthetic_states(n, token_ids=src.ids(n), vocab=vocab)
        cost.compression_seconds(cfg, st)
        with profile() as p:
            wall, cpu = cost.compression_seconds(cfg, st, warmup=False)
        res[n] = (wall, cpu, {e.key: e.self_cpu_time_total for e in p.key_averages()})
        print(n, "wall", round(wall, 3), "cpu", round(cpu, 3), flush=True)
    a, b = lengths[0], lengths[-1]
    ka, kb = res[a][2], res[b][2]
    print(f"{'op':40s} us/token@{a}  us/token@{b}  ratio")
    for k in sorted(kb, key=lambda k: -kb[k])[:15]:
        pa, pb = ka.get(k, 0) / a, kb[k] / b
        print(f"{k:40s} {pa:10.3f} {pb:10.3f} {pb / pa if pa else float('inf'):6.2f}")
    per_token = (sum(ka.values()) / a, sum(kb.values()) / b)
    print("total per token", round(per_token[0], 3), round(per_token[1], 3), round(per_token[1] / per_token[0], 2))
    if args.out:
        doc = json.loads(args.out.read_text()) if args.out.exists() else []
        doc.append({"preset": args.preset, "lengths": lengths, "cpu_s": [res[n][1] for n in lengths],
                    "op_us_per_token": [round(x, 3) for x in per_token], "ratio": round(per_token[1] / per_token[0], 3),
                    "load_average": load_average(), "command": " ".join(["python"] + sys.argv)})
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
