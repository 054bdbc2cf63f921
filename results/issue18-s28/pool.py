"""Pool the held-out agreement and fidelity runs of `kvzip-copy-heads-noquery` (seeds 19, 21, 22, 23: every
run with the preset's code as it is now, each seed in one run with the baselines) and compare it with SnapKV and
`kvzip` window by window: mean, paired wins, and a bootstrap 95 % interval of the mean difference.

    python results/issue18-s28/pool.py            # markdown tables on stdout
    python results/issue18-s28/pool.py --json out.json
    python results/issue18-s28/pool.py --preset kvzip-copy-heads-layers --baselines kvzip-copy-heads-noquery,snapkv,kvzip \
        --runs issue18-s28/heldout-agreement-2k-s27,issue18-s28/heldout-fidelity-2k-s27
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRESET = "kvzip-copy-heads-noquery"
BASELINES = ("snapkv", "kvzip", "streamingllm")
RUNS = {
    "agreement": ["issue18-s24/agreement-2k-s19", "issue18-s25/agreement-2k-s21-k0.5",
                  "issue18-s26/heldout-agreement-2k-s22", "issue18-s27/heldout-agreement-2k-s23"],
    "fidelity": ["issue18-s24/fidelity-2k-s19", "issue18-s25/fidelity-2k-s21-k0.5",
                 "issue18-s26/heldout-fidelity-2k-s22", "issue18-s27/heldout-fidelity-2k-s23"],
}
# metric -> True when higher is better
METRICS = {"agreement": {"lcs": True, "lead": True, "forced_kl": False}, "fidelity": {"kl": False}}


def cells(task: str) -> dict:
    """(budget, metric) -> method -> {(seed, sample_id): value}"""
    out: dict = {}
    for run in RUNS[task]:
        if not (ROOT / run / "cells.jsonl").exists():
            continue
        seed = json.loads((ROOT / run / "run.json").read_text())["seed"]
        for line in (ROOT / run / "cells.jsonl").read_text().splitlines():
            r = json.loads(line)
            for metric in METRICS[task]:
                if r.get(metric) is None:
                    continue
                out.setdefault((r["budget"], metric), {}).setdefault(r["method"], {})[(seed, r["sample_id"])] = r[metric]
    return out


def bootstrap(diffs: list[float], rounds: int = 10000, seed: int = 0) -> tuple[float, float]:
    rng = random.Random(seed)
    n = len(diffs)
    means = sorted(sum(rng.choice(diffs) for _ in range(n)) / n for _ in range(rounds))
    return means[int(0.025 * rounds)], means[int(0.975 * rounds)]


def compare(task: str) -> list[dict]:
    rows = []
    for (budget, metric), by_method in sorted(cells(task).items(), key=lambda kv: (-kv[0][0], kv[0][1])):
        ours = by_method.get(PRESET)
        if not ours:
            continue
        higher = METRICS[task][metric]
        for base in BASELINES:
            theirs = by_method.get(base)
            if not theirs:
                continue
            keys = sorted(set(ours) & set(theirs))
            diffs = [ours[k] - theirs[k] for k in keys]
            wins = sum((d > 0) if higher else (d < 0) for d in diffs)
            ties = sum(d == 0 for d in diffs)
            lo, hi = bootstrap(diffs)
            rows.append({
                "task": task, "budget": budget, "metric": metric, "baseline": base, "windows": len(keys),
                "seeds": sorted({k[0] for k in keys}),
                "ours": sum(ours[k] for k in keys) / len(keys), "theirs": sum(theirs[k] for k in keys) / len(keys),
                "wins": wins, "ties": ties, "losses": len(keys) - wins - ties,
                "diff": sum(diffs) / len(diffs), "ci95": [lo, hi], "higher_is_better": higher,
            })
    return rows


def main() -> None:
    global PRESET, BASELINES
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--preset", default=PRESET)
    ap.add_argument("--baselines", default=",".join(BASELINES))
    ap.add_argument("--runs", default=None, help="run folders under results/ (agreement-* and fidelity-*), comma-separated")
    args = ap.parse_args()
    PRESET, BASELINES = args.preset, tuple(args.baselines.split(","))
    if args.runs:
        runs = args.runs.split(",")
        RUNS["agreement"] = [r for r in runs if "agreement" in r]
        RUNS["fidelity"] = [r for r in runs if "fidelity" in r]
    rows = compare("agreement") + compare("fidelity")
    print(f"| task | keep | metric | vs | windows (seeds) | {PRESET} | baseline | wins/ties/losses | diff [95 % CI] |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        fmt = ".3f" if r["metric"] in ("lcs", "lead") else ".4f"
        seeds = ",".join(str(s) for s in r["seeds"])
        print(f"| {r['task']} | {r['budget']} | {r['metric']} | {r['baseline']} | {r['windows']} ({seeds}) | "
              f"{r['ours']:{fmt}} | {r['theirs']:{fmt}} | {r['wins']}/{r['ties']}/{r['losses']} | "
              f"{r['diff']:+{fmt}} [{r['ci95'][0]:+{fmt}}, {r['ci95'][1]:+{fmt}}] |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
