"""Tables of session 29's held-out runs (seeds 28+), per method.

    python results/issue18-s29/summary.py
"""

import json
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
ORDER = ["full", "kvzip-copy-heads-layers-sentences", "kvzip-copy-heads-layers", "kvzip-copy-heads-noquery", "kvzip-copy-heads-whole", "snapkv", "kvzip",
         "streamingllm"]


def rows(folder):
    p = HERE / folder / "cells.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []


def facts(folder):
    hits = defaultdict(lambda: [0, 0, True])
    for r in rows(folder):
        h = hits[r["method"]]
        h[0] += bool(r["hit"])
        h[1] += 1
        h[2] = h[2] and r.get("budget_met", True)
    return hits


def means(folder, metric):
    out = defaultdict(list)
    for r in rows(folder):
        out[(r["budget"], r["method"])].append(r[metric])
    return {k: (sum(v) / len(v), len(v)) for k, v in out.items()}


def main():
    for folder in sorted(p.name for p in HERE.iterdir() if p.is_dir() and p.name.startswith("heldout-")):
        task = folder.split("-")[1]
        print(f"### {folder}\n")
        if task in ("word", "distractors", "number", "aware"):
            h = facts(folder)
            print("| method | hits | budget met |\n|---|---|---|")
            for m in sorted(h, key=lambda m: ORDER.index(m) if m in ORDER else 99):
                print(f"| {m} | {h[m][0]}/{h[m][1]} | {h[m][2]} |")
        else:
            metrics = ["kl"] if task == "fidelity" else ["lcs", "forced_kl", "lead"]
            for metric in metrics:
                mm = means(folder, metric)
                print(f"| {metric} | " + " | ".join(f"keep {b}" for b in (0.5, 0.25)) + " |\n|---|---|---|")
                for m in ORDER:
                    cells = [mm.get((b, m)) for b in (0.5, 0.25)]
                    if any(cells):
                        print(f"| {m} | " + " | ".join("" if c is None else f"{c[0]:.4f} (n={c[1]})" for c in cells) + " |")
                print()
        print()


if __name__ == "__main__":
    main()
