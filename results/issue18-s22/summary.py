"""Session 22's held-out runs (seeds 14-17, never used for tuning; PG 2k (14, 15) and 4k (16, 17), question after compression), every
method in one run: per method and budget the mean of each metric, and window-by-window wins / ties / losses of
each method against SnapKV and against kvzip. Agreement: greedy LCS / 64 and lead, and the teacher-forced
metrics on the full cache's answer path (forced_kl lower is better, forced_top1 and forced_lead higher).
Fidelity: KL(full || compressed) over 256 teacher-forced continuation tokens (lower is better).
Facts (session 23, seed 18): hits out of the samples per method at keep 0.25, the full cache beside them, and per depth.
Usage: python results/issue18-s22/summary.py"""
import collections
import json
from pathlib import Path

HERE = Path(__file__).parent
TASKS = {
    "agreement": (["agreement-2k-s14", "agreement-2k-s15"], ["lcs", "lead", "forced_kl", "forced_top1", "forced_lead"]),
    "agreement 4k": (["agreement-4k-s16", "agreement-4k-s17"], ["lcs", "lead", "forced_kl", "forced_top1", "forced_lead"]),
    "fidelity": (["fidelity-2k-s14"], ["kl", "top1"]),
}
LOWER_IS_BETTER = {"forced_kl", "kl"}
BASELINES = ("snapkv", "kvzip")


def load(dirs):
    """{(method, budget): {window: record}} over the runs' cells; windows are keyed by run and sample."""
    out = collections.defaultdict(dict)
    for d in dirs:
        path = HERE / d / "cells.jsonl"
        for line in (path.read_text().splitlines() if path.exists() else []):
            r = json.loads(line)
            out[(r["method"], r["budget"])][(d, r["sample_id"])] = r
    return out


def wtl(rows, base, metric):
    common = [s for s in rows if s in base]
    sign = -1 if metric in LOWER_IS_BETTER else 1
    w = sum(sign * (rows[s][metric] - base[s][metric]) > 0 for s in common)
    t = sum(rows[s][metric] == base[s][metric] for s in common)
    return f"{w}/{t}/{len(common) - w - t}"


FACTS = ["word-2k-s18", "distractors-2k-s18", "number-2k-s18"]


def facts():
    print("\n### facts, keep 0.25, question after compression (" + ", ".join(FACTS) + ")\n")
    cells = {}
    for d in FACTS:
        path = HERE / d / "cells.jsonl"
        for line in (path.read_text().splitlines() if path.exists() else []):
            r = json.loads(line)
            cells.setdefault(d, {}).setdefault(r["method"], []).append(r)
    methods = sorted({m for by in cells.values() for m in by}, key=lambda m: (m != "full", m))
    print("| fact | " + " | ".join(methods) + " | aligned's misses (depth) |")
    print("|" + "---|" * (len(methods) + 2))
    for d, by in cells.items():
        hits = [f"{sum(r['hit'] for r in by.get(m, []))}/{len(by.get(m, []))}" for m in methods]
        miss = sorted(r["depth"] for r in by.get("kvzip-copy-heads-aligned", []) if not r["hit"])
        print(f"| {d} | " + " | ".join(hits) + f" | {miss} |")


def main():
    for task, (dirs, metrics) in TASKS.items():
        by = load(dirs)
        print(f"\n### {task} ({', '.join(dirs)})\n")
        head = ["keep", "method", "n"] + metrics + [f"{m} vs {b}" for b in BASELINES for m in metrics[:1] + metrics[2:3]]
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for (method, budget), rows in sorted(by.items(), key=lambda kv: (-kv[0][1], kv[0][0])):
            means = [sum(r[m] for r in rows.values()) / len(rows) for m in metrics]
            vs = [wtl(rows, by[(b, budget)], m) if method != b else "" for b in BASELINES for m in metrics[:1] + metrics[2:3]]
            cols = [f"{budget}", method, str(len(rows))] + [f"{v:.4f}" if v < 1 else f"{v:.2f}" for v in means] + vs
            print("| " + " | ".join(cols) + " |")


if __name__ == "__main__":
    main()
    facts()
