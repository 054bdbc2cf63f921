"""Session 26's dev probes of kvzip-copy-heads-noquery at keep 0.25 / 0.5 (PG 2k; seed 13: dev; seed 20: spent by
session 24, so a diagnosis here): merging every dropped token (clusterer.threshold -1 / 0), slots of their own for the
dropped tokens (residual.patch, 3 of 8 windows), and the heads without sentences giving less room to their own
reconstruction-ranked tokens (other_token_share 0.25 / 0.0). Fidelity KL per method (lower is better) and, per variant,
the windows where it is below noquery; facts: hits of the number among distractor numbers.
Usage: python results/issue18-s26/summary.py"""
import collections
import json
from pathlib import Path

HERE = Path(__file__).parent
BASE = "kvzip-copy-heads-noquery"


def fidelity(run):
    by = collections.defaultdict(dict)
    for line in (HERE / run / "cells.jsonl").read_text().splitlines():
        r = json.loads(line)
        by[(r["method"], r["budget"])][r["sample_id"]] = r["kl"]
    print(f"\n### {run}\n\n| keep | method | n | fidelity KL | below noquery |\n|---|---|---|---|---|")
    for (m, b), v in sorted(by.items(), key=lambda kv: (-kv[0][1], kv[0][0])):
        ref = by.get((BASE, b), {})
        common = [s for s in v if s in ref]
        below = sum(v[s] < ref[s] for s in common)
        print(f"| {b} | {m} | {len(v)} | {sum(v.values()) / len(v):.4f} | {below}/{len(common)} |")


def facts(run):
    by = collections.defaultdict(list)
    for line in (HERE / run / "cells.jsonl").read_text().splitlines():
        r = json.loads(line)
        by[r["method"]].append(r)
    print(f"\n### {run}\n\n| method | hits | misses (depth, sample) |\n|---|---|---|")
    for m, rows in by.items():
        miss = [f"{r['depth']}/{r['sample_id'][-2:]}" for r in rows if not r["hit"]]
        print(f"| {m} | {sum(r['hit'] for r in rows)}/{len(rows)} | {', '.join(miss)} |")


def agreement(run):
    by = collections.defaultdict(dict)
    for line in (HERE / run / "cells.jsonl").read_text().splitlines():
        r = json.loads(line)
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


if __name__ == "__main__":
    for run in ("mergeall-fidelity-2k-s13", "residual-fidelity-2k-s13", "ots-fidelity-2k-s13"):
        fidelity(run)
    facts("ots-distractors-2k-s20")
    # seed 22, never used before: the balanced variant (noquery-ots0.25.json) beside the preset and the baselines
    fidelity("heldout-fidelity-2k-s22")
    if (HERE / "heldout-agreement-2k-s22" / "cells.jsonl").exists():
        agreement("heldout-agreement-2k-s22")
    for task in ("word", "distractors", "number"):
        if (HERE / f"heldout-{task}-2k-s22" / "cells.jsonl").exists():
            facts(f"heldout-{task}-2k-s22")
