"""Session 18's issue-18 tables: kvzip-copy-heads-lead pooled over four seeds, and kvzip-copy-heads-aligned beside it on
seed 3's 2k facts, the depth-0.9 samples of every seed, and agreement / KL paired by window (per seed and pooled); the other methods' cells of the
same samples are the committed runs'.
    python results/issue18-s18/summary.py        # markdown to stdout, summary.json beside this file"""
import json
import statistics
from pathlib import Path

HERE = Path(__file__).parent
R = HERE.parent
SEEDS = {0: R / "issue18-grid6", 1: R / "issue18-heldout", 2: R / "issue18-seed2", 3: R / "issue18-seed3"}
TASKS = ("word-2k", "distractors-2k", "number-2k", "word-4k", "distractors-4k", "number-4k")
BASE = ("full", "snapkv", "kvzip", "kvzip-copy-heads-banded")
LEAD, ALIGNED = "kvzip-copy-heads-lead", "kvzip-copy-heads-aligned"


def cells(path: Path) -> dict:
    """{method: {(depth, sample): hit}} of a facts run (the agnostic protocol)."""
    out = {}
    if path.exists():
        for line in path.read_text().splitlines():
            c = json.loads(line)
            if c.get("protocol", "agnostic") == "agnostic":
                out.setdefault(c["method"], {})[(c["depth"], c["sample"])] = c["hit"]
    return out


def facts(task: str, seed: int) -> dict:
    got = cells(SEEDS[seed] / task / "cells.jsonl")
    lead = dict(got.get(LEAD, {}))
    for extra in (HERE / f"lead-{task}-s{seed}", R / "issue18-s17dev" / f"lead-d05-4k-s{seed}"):
        if extra.name.startswith("lead-d05") and task != "distractors-4k":
            continue
        lead.update(cells(extra / "cells.jsonl").get(LEAD, {}))
    if lead:
        got[LEAD] = lead
    aligned = {}
    for extra in sorted(HERE.glob(f"aligned-{task}-*s{seed}")) + [HERE / f"aligned-{task}-s{seed}"]:  # -dDEPTHS- parts
        aligned.update(cells(extra / "cells.jsonl").get(ALIGNED, {}))
    if aligned:
        got[ALIGNED] = aligned
    return got


def score(d: dict, keys=None) -> str:
    keys = list(d) if keys is None else [k for k in keys if k in d]
    return f"{sum(d[k] for k in keys)}/{len(keys)}" if keys else ""


out = {"lead_pooled": {}, "aligned_seed3": {}, "depth09": {}}
methods = (*BASE, LEAD)
print("| keep 0.25, seeds 0-3 | " + " | ".join(methods) + " |\n|---|" + "---|" * len(methods))
for task in TASKS:
    per = [facts(task, s) for s in SEEDS]
    if not all(len(p.get(LEAD, {})) == 10 for p in per):
        continue
    row = {m: [sum(sum(p[m].values()) for p in per), sum(len(p[m]) for p in per)] for m in methods}
    out["lead_pooled"][task] = row
    print(f"| {task} | " + " | ".join(f"{a}/{b}" for a, b in row.values()) + " |")
print()
methods = (*BASE, LEAD, ALIGNED)
print("| keep 0.25, seeds 0-3 | " + " | ".join(methods) + " |\n|---|" + "---|" * len(methods))
for task in TASKS:
    per = [facts(task, s) for s in SEEDS]
    if not all(len(p.get(ALIGNED, {})) == 10 for p in per):
        continue
    row = {m: [sum(sum(p.get(m, {}).values()) for p in per), sum(len(p.get(m, {})) for p in per)] for m in methods}
    out.setdefault("aligned_pooled", {})[task] = row
    print(f"| {task} | " + " | ".join(f"{a}/{b}" if b else "" for a, b in row.values()) + " |")
print()
print("| seed 3, keep 0.25 | " + " | ".join(methods) + " |\n|---|" + "---|" * len(methods))
for task in TASKS:
    f = facts(task, 3)
    if len(f.get(ALIGNED, {})) != 10:
        continue
    out["aligned_seed3"][task] = {m: score(f[m]) for m in methods}
    print(f"| {task} | " + " | ".join(score(f[m]) for m in methods) + " |")
print()
print("| depth 0.9 (2 a seed) | seeds | " + " | ".join(methods) + " |\n|---|---|" + "---|" * len(methods))
for task in TASKS:
    seeds = [s for s in SEEDS if any(k[0] == 0.9 for k in facts(task, s).get(ALIGNED, {}))]
    if not seeds:
        continue
    tot = {}
    for s in seeds:
        f = facts(task, s)
        for m in methods:
            keys = [k for k in f.get(m, {}) if k[0] == 0.9]
            a, b = tot.get(m, (0, 0))
            tot[m] = (a + sum(f[m][k] for k in keys), b + len(keys))
    out["depth09"][task] = {"seeds": seeds, **{m: list(v) for m, v in tot.items()}}
    print(f"| {task} | {','.join(map(str, seeds))} | " + " | ".join(f"{a}/{b}" if b else "" for a, b in tot.values()) + " |")
PAIRED = (("agreement-2k", "lcs", "LCS / 64", 1), ("agreement-4k", "lcs", "LCS / 64", 1),
          ("fidelity-4k", "kl", "KL(full || compressed)", -1))  # sign: +1 higher is better, -1 lower is


def paired(step: str, seed: int) -> tuple[dict, dict]:
    """The aligned run's cells of one seed and the committed run's of the same windows, keyed (seed, window, keep)."""
    path = HERE / f"aligned-{step}-s{seed}" / "cells.jsonl"
    if not path.exists():
        return {}, {}
    mine = {(seed, c["sample_id"], c["budget"]): c for c in map(json.loads, path.read_text().splitlines())
            if c["method"] == ALIGNED}
    theirs = {}
    for c in map(json.loads, (SEEDS[seed] / step / "cells.jsonl").read_text().splitlines()):
        theirs.setdefault(c["method"], {})[(seed, c["sample_id"], c["budget"])] = c
    return mine, theirs


for step, field, what, sign in PAIRED:
    rows = []  # (label, mine, theirs) per seed, then pooled
    for seed in SEEDS:
        mine, theirs = paired(step, seed)
        if mine:
            rows.append((f"seed {seed}", mine, theirs))
    if len(rows) > 1:
        pool_m, pool_t = {}, {}
        for _, m, t in rows:
            pool_m.update(m)
            for k, v in t.items():
                pool_t.setdefault(k, {}).update(v)
        rows.append(("seeds " + ",".join(r[0][5:] for r in rows), pool_m, pool_t))
    if not rows:
        continue
    others = [m for m in (LEAD, "kvzip-copy-heads-banded", "snapkv", "streamingllm", "kvzip") if all(m in r[2] for r in rows)]
    print()
    print(f"| {step}, {what} | keep | windows | aligned | " + " | ".join(o.replace("kvzip-copy-heads-", "")
          for o in others) + " | aligned better than snapkv (w/t/l) | than kvzip |" + (" than lead |" if LEAD in others else ""))
    print("|---|---|---|---|" + "---|" * len(others) + "---|---|" + ("---|" if LEAD in others else ""))
    for label, mine, theirs in rows:
        for budget in (0.5, 0.25):
            keys = sorted(k for k in mine if k[2] == budget and all(k in theirs[m] for m in others))
            if not keys:
                continue
            mean = lambda m: statistics.mean((mine if m == ALIGNED else theirs[m])[k][field] for k in keys)
            def vs(m):
                d = [sign * (mine[k][field] - theirs[m][k][field]) for k in keys]
                return f"{statistics.mean(d):+.4f} ({sum(x > 0 for x in d)}/{sum(x == 0 for x in d)}/{sum(x < 0 for x in d)})"
            row = {m: round(mean(m), 4) for m in (ALIGNED, *others)}
            versus = {"vs_snapkv": vs("snapkv"), "vs_kvzip": vs("kvzip")} | ({"vs_lead": vs(LEAD)} if LEAD in others else {})
            out.setdefault(step, {})[f"{label}, keep {budget}"] = {"windows": len(keys), **row, **versus}
            print(f"| {label} | {budget} | {len(keys)} | " + " | ".join(f"{v:.4f}" for v in row.values())
                  + " | " + " | ".join(versus.values()) + " |")
(HERE / "summary.json").write_text(json.dumps(out, indent=1))
