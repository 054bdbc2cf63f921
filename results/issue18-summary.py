"""Markdown tables of the issue-18 runs (cells.jsonl of each results/issue18-* directory).

    python results/issue18-summary.py
"""

from __future__ import annotations

import collections
import json
from pathlib import Path

ROOT = Path(__file__).parent
QA = {"word (code-word fact)": "issue18-niah-word", "number among distractors": "issue18-niah-distractors",
      "planted number": "issue18-niah-number", "word, query-aware": "issue18-niah-word-aware"}


def rows(name):
    path = ROOT / name / "cells.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def order(methods):
    first = ["full", "snapkv", "kvzip", "kvzip-adakv"]
    return [m for m in first if m in methods] + sorted(m for m in methods if m not in first)


def qa_table():
    cols = {title: rows(d) for title, d in QA.items()}
    cols = {t: r for t, r in cols.items() if r}
    methods = order({r["method"] for rs in cols.values() for r in rs})
    print("| method | " + " | ".join(cols) + " |")
    print("|---|" + "---|" * len(cols))
    for m in methods:
        cells = []
        for rs in cols.values():
            mine = [r for r in rs if r["method"] == m]
            if not mine:
                cells.append("")
                continue
            hits = sum(bool(r["hit"]) for r in mine)
            keep = max(r["keep_max"] for r in mine)
            met = all(r["budget_met"] for r in mine)
            cells.append(f"{hits}/{len(mine)} (keep {keep:.3f}{'' if met else ', not met'})")
        print(f"| {m} | " + " | ".join(cells) + " |")


def mean_table(name, keys):
    rs = rows(name)
    if not rs:
        return
    by = collections.defaultdict(list)
    for r in rs:
        by[(r["method"], r["budget"])].append(r)
    budgets = sorted({b for _, b in by if b < 1.0}, reverse=True)
    print(f"\n{name}: mean over {len({r['sample_id'] for r in rs})} windows")
    print("| method | " + " | ".join(f"{k} @ {b}" for b in budgets for k in keys) + " |")
    print("|---|" + "---|" * (len(budgets) * len(keys)))
    for m in order({m for m, _ in by}):
        if m == "full":
            continue
        cells = []
        for b in budgets:
            mine = by.get((m, b), [])
            for k in keys:
                vals = [r[k] for r in mine if r.get(k) is not None]
                cells.append(f"{sum(vals) / len(vals):.4f}" if vals else "")
        print(f"| {m} | " + " | ".join(cells) + " |")


def cost():
    seen = {}
    for d in QA.values():
        for r in rows(d):
            if r.get("reconstruct_s", 0) > 0:
                seen[(d, r["sample_id"])] = (r["reconstruct_s"], r["prefill_s"], r["context_tokens"])
    if seen:
        ratios = [a / b for a, b, _ in seen.values()]
        print(f"\nreconstruction pass / prefill over {len(seen)} samples: mean {sum(ratios) / len(ratios):.2f} "
              f"(min {min(ratios):.2f}, max {max(ratios):.2f})")


if __name__ == "__main__":
    qa_table()
    mean_table("issue18-fidelity", ["kl", "top1"])
    mean_table("issue18-agreement", ["lcs", "lead"])
    cost()
