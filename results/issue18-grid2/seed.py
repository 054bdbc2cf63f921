"""Seed this grid with the cells of results/issue18-grid (session 5: same model, samples, seed 0,
prompt hashes and code paths for these presets) so that only the new presets are run here; the
eval's resume checks each cell's prompt hash. Two seeded cells per task are left out on purpose
(snapkv and kvzip-sentences-median at depth 0.5, sample 0) and rerun, to check they reproduce
(check.py compares them).

    python results/issue18-grid2/seed.py
"""
import json
from pathlib import Path

HERE = Path(__file__).parent
OLD = HERE.parent / "issue18-grid"
KEEP = {"full", "streamingllm", "snapkv", "kvzip", "kvzip-sentences-median", "kvzip-d2o-tokens"}
RERUN = ("-d0.5-s0|snapkv|", "-d0.5-s0|kvzip-sentences-median|", "-s0|snapkv|0.25", "-s0|kvzip-sentences-median|0.25")
for task in ("word", "distractors", "number", "fidelity", "agreement", "aware-distractors"):
    (HERE / task).mkdir(exist_ok=True)
    out = HERE / task / "cells.jsonl"
    if out.exists():
        continue
    kept, rerun = [], []
    for line in (OLD / task / "cells.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["method"] not in KEEP:
            continue
        first_sample = r["key"].split("|")[0].endswith(("-d0.5-s0", "-s0")) and r["key"].split("|")[0] in (
            "fact_code-word-L2048-d0.5-s0", "fact_number_distractors-L2048-d0.5-s0", "niah-number-L2048-d0.5-s0",
            "fidelity-P1024-C256-s0", "agreement-L1024-s0")
        if first_sample and r["method"] in ("snapkv", "kvzip-sentences-median"):
            rerun.append(r)
            continue
        kept.append(line)
    out.write_text("".join(l + "\n" for l in kept))
    (HERE / task / "seeded-reruns.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rerun))
    print(task, len(kept), "seeded,", len(rerun), "to rerun")
