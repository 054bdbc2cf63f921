"""Seed this grid with every cell of results/issue18-grid2 (session 6: same model, samples, seed 0,
prompt hashes; the baselines' code paths are unchanged by session 7, which only adds the copy score
to the reconstruction pass's carried data) so that only the new preset runs here; the eval's resume
checks each cell's prompt hash.

    python results/issue18-grid3/seed.py
"""
import shutil
from pathlib import Path

HERE = Path(__file__).parent
OLD = HERE.parent / "issue18-grid2"
for task in ("word", "distractors", "number", "fidelity", "agreement", "aware-distractors"):
    (HERE / task).mkdir(exist_ok=True)
    if (HERE / task / "cells.jsonl").exists():
        continue
    for name in ("cells.jsonl", "run.json"):
        shutil.copy(OLD / task / name, HERE / task / name)
    print(task, sum(1 for _ in open(HERE / task / "cells.jsonl")), "cells seeded")
