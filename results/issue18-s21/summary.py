"""Session 21's agreement runs (PG 2k, keep 0.25, 64 greedy tokens, question after compression): mean LCS / 64 and lead
per method, and each method against SnapKV window by window (w/t/l). Usage: python results/issue18-s21/summary.py"""
import collections
import json
from pathlib import Path

HERE = Path(__file__).parent
RUNS = {"seed 11 (dev)": ["dev-a", "dev-b"], "seed 12 (held out)": ["heldout-s12"]}


def cells(dirs):
    out = collections.defaultdict(dict)
    for d in dirs:
        path = HERE / d / "cells.jsonl"
        if path.exists():
            for line in path.read_text().splitlines():
                r = json.loads(line)
                if r["budget"] == 0.25:
                    out[r["method"]][r["sample_id"]] = r
    return out


def main():
    print("| windows | method | n | LCS / 64 | lead | vs snapkv (w/t/l) |")
    print("|---|---|---|---|---|---|")
    for name, dirs in RUNS.items():
        by = cells(dirs)
        base = by.get("snapkv", {})
        for method, rows in by.items():
            n = len(rows)
            lcs = sum(r["lcs"] for r in rows.values()) / n
            lead = sum(r["lead"] for r in rows.values()) / n
            common = [s for s in rows if s in base]
            w = sum(rows[s]["lcs"] > base[s]["lcs"] for s in common)
            t = sum(rows[s]["lcs"] == base[s]["lcs"] for s in common)
            vs = "" if method == "snapkv" else f"{w}/{t}/{len(common) - w - t}"
            print(f"| {name} | {method} | {n} | {lcs:.3f} | {lead:.2f} | {vs} |")


if __name__ == "__main__":
    main()
