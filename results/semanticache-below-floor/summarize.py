"""Markdown tables of this directory's results (python results/semanticache-below-floor/summarize.py)."""

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
COLUMNS = {"fidelity": ["kl", "top1"], "fidelity-short": ["kl", "top1"], "niah": ["accuracy", "leading_digits"]}

for name, cols in COLUMNS.items():
    path = HERE / name / "results.json"
    if not path.is_file():
        continue
    data = json.loads(path.read_text())
    print(f"\n### {name}\n")
    print("| method | budget | n | " + " | ".join(cols) + " | keep_max | budget met |")
    print("|---|---|---|" + "---|" * len(cols) + "---|---|")
    for r in data["aggregate"]:
        vals = " | ".join("" if r.get(c) is None else f"{r[c]:.3f}" for c in cols)
        print(f"| {r['method']} | {r['budget']} | {r['n']} | {vals} | {r['keep_max']:.3f} | {r['budget_met']} |")
