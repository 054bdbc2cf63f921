"""Markdown tables of the issue-14 targets from the runs' cells.jsonl (run.sh):
    python results/issue14-targets/table.py results/issue14-targets
"""
import json, sys
from pathlib import Path

root = Path(sys.argv[1] if len(sys.argv) > 1 else "results/issue14-targets")
PAIRS = [("centroidkv", "centroidkv-fitted"), ("centroidkv-safe", "centroidkv-safe-fitted"),
         ("semanticache-fixed64", "semanticache-fitted"), ("kvzip-csm", "kvzip-csm-fitted")]
# session 8: centroidkv-safe-fitted's guard reads a 64-query window; its same-cluster twin (when run)
SAME_CLUSTERS = {"centroidkv-safe-fitted": "centroidkv-safe:query_window=64"}
HAY = ["pg", "pydoc"]
BUDGETS = [0.5, 0.25]


def load(task, hay):
    path = root / f"{task}-{hay}" / "cells.jsonl"
    if not path.exists():
        return {}
    out = {}
    for line in open(path):
        if line.strip():
            r = json.loads(line)
            out[(r["method"], r["budget"])] = r
    return out


fid = {h: load("fidelity", h) for h in HAY}
agr = {h: load("agreement", h) for h in HAY}
cols = [(h, b) for h in HAY for b in BUDGETS]
head = " | ".join(f"{h} {b}" for h, b in cols)
print(f"KL(full || compressed), fitted vs its mean-merger twin (same clusters)\n\n| method | {head} |")
print("|---" * (len(cols) + 1) + "|")


def cell(table, key, field, fmt="{:.4f}"):
    r = table.get(key)
    return fmt.format(r[field]) if r else "—"


def vs(name, twin, label=None):
    row = []
    for h, b in cols:
        v = cell(fid[h], (name, b), "kl")
        if twin and (twin, b) in fid[h] and (name, b) in fid[h]:
            v += f" ({fid[h][(name, b)]['kl'] / fid[h][(twin, b)]['kl'] - 1:+.1%})"
        row.append(v)
    print(f"| {label or f'`{name}`'} | " + " | ".join(row) + " |")


shown = set()
for mean, fitted in PAIRS:
    twin = SAME_CLUSTERS.get(fitted)
    present = any((twin, b) in fid[h] for h, b in cols) if twin else False
    vs(mean, None)
    if present:
        vs(twin, None)
        vs(fitted, twin, f"`{fitted}` vs `{twin}`")
        vs(fitted, mean, f"`{fitted}` vs `{mean}`")
    else:
        vs(fitted, mean)
    closed = f"{fitted}:merger.refine=0"
    if any((closed, b) in fid[h] for h, b in cols):
        vs(closed, twin if present else mean)
    shown |= {mean, fitted, closed} | ({twin} if present else set())
others = sorted({m for h in HAY for (m, _) in fid[h]} - shown - {"full"})
for name in others:
    print(f"| `{name}` | " + " | ".join(cell(fid[h], (name, b), "kl") for h, b in cols) + " |")
print(f"\nGeneration agreement (greedy 64 tokens after the compressed context + a summary request): LCS / 64, leading tokens\n\n| method | {head} |")
print("|---" * (len(cols) + 1) + "|")
names = [n for p in PAIRS for n in p] + sorted({m for h in HAY for (m, _) in agr[h]} - {n for p in PAIRS for n in p})
for name in names:
    if not any((name, b) in agr[h] for h, b in cols):
        continue
    row = [f"{agr[h][(name, b)]['lcs']:.2f} / {agr[h][(name, b)]['lead']}" if (name, b) in agr[h] else "—" for h, b in cols]
    print(f"| `{name}` | " + " | ".join(row) + " |")
