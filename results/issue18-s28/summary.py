"""Tables of session 28's runs: the held-out seed 27 (2k) and the 4k seed-26 runs, per method.

    python results/issue18-s28/summary.py
"""

import json
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
ORDER = ["full", "kvzip-copy-heads-layers", "kvzip-copy-heads-noquery", "kvzip-copy-heads-whole", "snapkv", "kvzip",
         "streamingllm"]


def rows(folder, here=HERE):
    p = here / folder / "cells.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []


def facts(folder, here=HERE):
    hits = defaultdict(lambda: [0, 0, True])
    for r in rows(folder, here):
        h = hits[r["method"]]
        h[0] += bool(r["hit"])
        h[1] += 1
        h[2] = h[2] and r.get("budget_met", True)
    return hits


def means(folder, metric, here=HERE):
    out = defaultdict(list)
    for r in rows(folder, here):
        out[(r["budget"], r["method"])].append(r[metric])
    return {k: (sum(v) / len(v), len(v)) for k, v in out.items()}


def main(here=HERE, order=ORDER):
    """Markdown tables of every heldout-* run folder under ``here``, methods in ``order`` first."""
    for folder in sorted(p.name for p in here.iterdir() if p.is_dir() and p.name.startswith("heldout-")):
        task = folder.split("-")[1]
        print(f"### {folder}\n")
        if task in ("word", "distractors", "number", "aware"):
            h = facts(folder, here)
            print("| method | hits | budget met |\n|---|---|---|")
            for m in sorted(h, key=lambda m: order.index(m) if m in order else 99):
                print(f"| {m} | {h[m][0]}/{h[m][1]} | {h[m][2]} |")
        else:
            metrics = ["kl"] if task == "fidelity" else ["lcs", "forced_kl", "lead"]
            for metric in metrics:
                mm = means(folder, metric, here)
                print(f"| {metric} | " + " | ".join(f"keep {b}" for b in (0.5, 0.25)) + " |\n|---|---|---|")
                for m in order:
                    cells = [mm.get((b, m)) for b in (0.5, 0.25)]
                    if any(cells):
                        print(f"| {m} | " + " | ".join("" if c is None else f"{c[0]:.4f} (n={c[1]})" for c in cells) + " |")
                print()
        print()


if __name__ == "__main__":
    main()
