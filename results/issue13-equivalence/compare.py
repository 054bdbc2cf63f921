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


def ident(r: dict) -> tuple:
    return (r["sample_id"], r["preset"], r["budget"], r["protocol"])


def diff(a: dict, b: dict) -> tuple[list, float]:
    """(differences, largest |KL/ppl difference|) between two records of one cell."""
    out, worst = [], 0.0
    for field in EXACT:
        if (field in a or field in b) and a.get(field) != b.get(field):
            out.append({"field": field, "base": a.get(field), "new": b.get(field)})
    for field in CLOSE:
        if a.get(field) is None and b.get(field) is None:
            continue
        d = abs(a[field] - b[field]) if math.isfinite(a[field]) else (0.0 if a[field] == b[field] else math.inf)
        worst = max(worst, d)
        if d > TOL:
            out.append({"field": field, "base": a[field], "new": b[field]})
    ta, tb = dict(flat(a.get("trace") or {})), dict(flat(b.get("trace") or {}))
    for name in sorted(set(ta) | set(tb)):
        if name not in ta or name not in tb or abs(ta[name] - tb[name]) > TOL:
            out.append({"field": f"trace.{name}", "base": ta.get(name), "new": tb.get(name)})
    return out, worst


def main(out: str) -> int:
    """Every cell of base vs new. A cell that differs and whose semanticache fallback chunker
    acted (new met a budget base missed) is compared again with new-nofallback (the same code
    with fallback_chunker=null): it must then be identical too."""
    report = {"tolerance": TOL, "runs": {}}
    bad = 0
    for run in ("niah", "niah-protect", "fidelity"):
        tree = {t: {ident(r): r for r in load(Path(out) / t / run / "cells.jsonl").values()}
                for t in ("base", "new", "new-nofallback") if (Path(out) / t / run / "cells.jsonl").exists()}
        base, new, nofb = tree["base"], tree["new"], tree.get("new-nofallback", {})
        cells, identical, explained, unexplained, worst = [], 0, 0, 0, 0.0
        for key in sorted(set(base) | set(new)):
            if key not in base or key not in new:
                cells.append({"cell": key, "missing_in": "base" if key not in base else "new"})
                unexplained += 1
                continue
            d, w = diff(base[key], new[key])
            if not d:
                worst = max(worst, w)
                identical += 1
                continue
            entry = {"cell": key, "differences_new": d}
            if key in nofb:
                d2, w2 = diff(base[key], nofb[key])
                entry["differences_with_fallback_chunker_off"] = d2
                entry["max_abs_diff_kl_ppl_fallback_off"] = w2
                if not d2:
                    explained += 1
                    entry["why"] = "semanticache's fallback chunker (intended budget change); identical without it"
                else:
                    unexplained += 1
            else:
                unexplained += 1
            cells.append(entry)
        report["runs"][run] = {"cells": len(base), "identical": identical,
                               "differ_only_by_the_fallback_chunker": explained, "unexplained": unexplained,
                               "max_abs_diff_kl_ppl_identical_cells": worst, "differing": cells}
        bad += unexplained
    report["verdict"] = "equivalent" if bad == 0 else f"{bad} unexplained differences"
    print(json.dumps(report, indent=1))
    return int(bad > 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
