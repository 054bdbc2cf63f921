"""Summarise the per-layer budget probe (layer_budget_probe.py): per window the fidelity KL at keep 0.25 of
kvzip-copy-heads-noquery, SnapKV and the layer splits, means and wins.

    python results/issue18-s28/layer_budget_summary.py
"""

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
rows = [json.loads(line) for p in sorted(HERE.glob("layer-budget-s*.jsonl")) for line in p.read_text().splitlines()]
cols = ["noquery", "snapkv", "x1.5", "x2"]
print("| seed | window | " + " | ".join(cols) + " | cache slots (noquery / x2) |")
print("|---|---|" + "---|" * len(cols) + "---|")
for r in rows:
    print(f"| {r['seed']} | {r['sample'][-2:]} | " + " | ".join(f"{r[c]:.4f}" for c in cols)
          + f" | {r['noquery_slots']} / {r['x2_slots']} |")
n = len(rows)
print(f"| mean | {n} windows | " + " | ".join(f"{sum(r[c] for r in rows) / n:.4f}" for c in cols) + " | |")
for c in ("x1.5", "x2"):
    for base in ("noquery", "snapkv"):
        wins = sum(r[c] < r[base] for r in rows)
        print(f"{c} below {base}: {wins}/{n}")
print("copy layers:", sorted({tuple(r["copy_layers"]) for r in rows}))
