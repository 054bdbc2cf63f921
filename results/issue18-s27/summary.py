"""Session 27: kvzip-copy-heads-whole (the copy heads' whole room to sentences) beside kvzip-copy-heads-noquery and the
baselines. Held out: seeds 23 and 24 (never used before; one run per task with every method); dev: the spent seeds
20 and 22, where noquery missed; seed 25 at 4k (one sample a depth) (whole added by a resumed run of copies of those folders).
Fidelity KL (lower is better), agreement (LCS / 64, forced KL), facts (hits, misses as depth/sample).
Usage: python results/issue18-s27/summary.py"""
import collections
import json
from pathlib import Path

HERE = Path(__file__).parent
BASE = "kvzip-copy-heads-noquery"


def cells(run):
    return [json.loads(line) for line in (HERE / run / "cells.jsonl").read_text().splitlines()]


def fidelity(run):
    by = collections.defaultdict(dict)
    for r in cells(run):
        by[(r["method"], r["budget"])][r["sample_id"]] = r["kl"]
    print(f"\n### {run}\n\n| keep | method | n | fidelity KL | below noquery / SnapKV / kvzip |\n|---|---|---|---|---|")
    for (m, b), v in sorted(by.items(), key=lambda kv: (-kv[0][1], kv[0][0])):
        below = []
        for ref_name in (BASE, "snapkv", "kvzip"):
            ref = by.get((ref_name, b), {})
            common = [s for s in v if s in ref]
            below.append(f"{sum(v[s] < ref[s] for s in common)}/{len(common)}")
        print(f"| {b} | {m} | {len(v)} | {sum(v.values()) / len(v):.4f} | {' / '.join(below)} |")


def agreement(run):
    by = collections.defaultdict(dict)
    for r in cells(run):
        by[(r["method"], r["budget"])][r["sample_id"]] = r
    print(f"\n### {run}\n\n| keep | method | n | LCS / 64 | forced KL | forced KL below noquery / SnapKV / kvzip |")
    print("|---|---|---|---|---|---|")
    for (m, b), v in sorted(by.items(), key=lambda kv: (-kv[0][1], kv[0][0])):
        below = []
        for ref_name in (BASE, "snapkv", "kvzip"):
            ref = by.get((ref_name, b), {})
            common = [s for s in v if s in ref]
            below.append(f"{sum(v[s]['forced_kl'] < ref[s]['forced_kl'] for s in common)}/{len(common)}")
        lcs = sum(r["lcs"] for r in v.values()) / len(v)
        fkl = sum(r["forced_kl"] for r in v.values()) / len(v)
        print(f"| {b} | {m} | {len(v)} | {lcs:.3f} | {fkl:.4f} | {' / '.join(below)} |")


def facts(run):
    by = collections.defaultdict(list)
    for r in cells(run):
        by[r["method"]].append(r)
    print(f"\n### {run}\n\n| method | hits | misses (depth/sample) |\n|---|---|---|")
    for m, rows in by.items():
        miss = [f"{r['depth']}/{r['sample_id'][-2:]}" for r in rows if not r["hit"]]
        print(f"| {m} | {sum(r['hit'] for r in rows)}/{len(rows)} | {', '.join(miss)} |")


if __name__ == "__main__":
    for seed in (23, 24):
        for task, show in (("fidelity", fidelity), ("agreement", agreement), ("word", facts),
                           ("distractors", facts), ("number", facts)):
            if (HERE / f"heldout-{task}-2k-s{seed}" / "cells.jsonl").exists():
                show(f"heldout-{task}-2k-s{seed}")
    if (HERE / "heldout-distractors-4k-s25" / "cells.jsonl").exists():
        facts("heldout-distractors-4k-s25")
    for run in ("dev-word-2k-s22", "dev-distractors-2k-s22", "dev-distractors-2k-s20"):
        if (HERE / run / "cells.jsonl").exists():
            facts(run)
