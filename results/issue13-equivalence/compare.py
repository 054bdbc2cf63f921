"""Compare the eval records of the two trees: python compare.py OUT > compare.json

OUT/{base,new}/{niah,niah-protect,fidelity}/cells.jsonl, one record per (sample, method, budget,
protocol). Identical: answer, hit, score, keep_max, keep_mean, budget_met, the needle traces
(within 1e-6). Fidelity: kl, kl_max, ppl within 1e-6 (absolute), top1 identical. Timings are not
compared here (speed.py). Exit status 1 when any record differs or is missing.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

EXACT = ("answer", "hit", "score", "leading_digits", "keep_max", "keep_mean", "budget_met", "layers_met",
         "top1", "positions", "context_tokens", "compressed_tokens", "prompt_sha")
CLOSE = ("kl", "kl_max", "ppl", "ppl_full", "ppl_delta")
TOL = 1e-6


def load(path: Path) -> dict:
    return {r["key"]: r for r in (json.loads(line) for line in path.read_text().splitlines() if line.strip())}


def flat(trace, prefix=""):
    if isinstance(trace, dict):
        for k, v in trace.items():
            yield from flat(v, f"{prefix}{k}.")
    elif isinstance(trace, list):
        for i, v in enumerate(trace):
            yield from flat(v, f"{prefix}{i}.")
    else:
        yield prefix.rstrip("."), trace


def main(out: str) -> int:
    report = {"tolerance": TOL, "runs": {}}
    bad = 0
    for run in ("niah", "niah-protect", "fidelity"):
        base, new = (load(Path(out) / tree / run / "cells.jsonl") for tree in ("base", "new"))
        diffs, max_close = [], 0.0
        for key in sorted(set(base) | set(new)):
            if key not in base or key not in new:
                diffs.append({"key": key, "missing_in": "base" if key not in base else "new"})
                continue
            a, b = base[key], new[key]
            for field in EXACT:
                if field in a or field in b:
                    if a.get(field) != b.get(field):
                        diffs.append({"key": key, "field": field, "base": a.get(field), "new": b.get(field)})
            for field in CLOSE:
                if a.get(field) is None and b.get(field) is None:
                    continue
                d = abs(a[field] - b[field]) if math.isfinite(a[field]) else (0.0 if a[field] == b[field] else math.inf)
                max_close = max(max_close, d)
                if d > TOL:
                    diffs.append({"key": key, "field": field, "base": a[field], "new": b[field]})
            ta, tb = dict(flat(a.get("trace") or {})), dict(flat(b.get("trace") or {}))
            for name in set(ta) | set(tb):
                if name not in ta or name not in tb or abs(ta[name] - tb[name]) > TOL:
                    diffs.append({"key": key, "field": f"trace.{name}", "base": ta.get(name), "new": tb.get(name)})
        report["runs"][run] = {"records": len(base), "identical": not diffs, "max_abs_diff_kl_ppl": max_close,
                               "diffs": diffs[:50]}
        bad += len(diffs)
    print(json.dumps(report, indent=1))
    return int(bad > 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
