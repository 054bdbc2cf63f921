"""Session 26: the fitted presets' KL against their mean-merger twins, as registered and with the fit reading every
2nd (4th) window query, from results/issue14-s26/targets-fidelity-{pg,pydoc} (2 windows each, keep 0.5 / 0.25).
Usage: python results/issue14-s26/targets_table.py"""
import collections
import json
from pathlib import Path

HERE = Path(__file__).parent
TWINS = {"centroidkv-fitted": "centroidkv", "semanticache-fitted": "semanticache-fixed64",
         "semanticache-safe-fitted": "semanticache-safe", "kvzip-csm-fitted": "kvzip-csm",
         "centroidkv-safe-fitted": "centroidkv-safe:query_window=64"}


def kl(run):
    by = collections.defaultdict(list)
    for line in (HERE / run / "cells.jsonl").read_text().splitlines():
        r = json.loads(line)
        by[(r["method"], r["budget"])].append(r["kl"])
    return {k: sum(v) / len(v) for k, v in by.items()}


print("| haystack | keep | fitted preset | twin KL | fitted KL (cut) | stride 2 KL (cut) | stride 4 KL (cut) | SnapKV |")
print("|---|---|---|---|---|---|---|---|")
for hs in ("pg", "pydoc"):
    m = kl(f"targets-fidelity-{hs}")
    for b in (0.5, 0.25):
        for fitted, twin in TWINS.items():
            t = m[(twin, b)]
            cells = []
            for name in (fitted, f"{fitted}:merger.query_stride=2", f"{fitted}:merger.query_stride=4"):
                v = m.get((name, b))
                cells.append("" if v is None else f"{v:.4f} ({100 * (v / t - 1):+.1f}%)")
            print(f"| {hs} | {b} | {fitted} | {t:.4f} | " + " | ".join(cells) + f" | {m[('snapkv', b)]:.4f} |")
