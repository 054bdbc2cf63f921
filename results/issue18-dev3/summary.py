"""The dev QA and fidelity cells of run-dev.sh / run-dev2.sh (pydoc_data.topics, seed 101, 1k
tokens, keep 0.25 for QA, 0.5 / 0.25 for fidelity): hits per method and mean KL.

    python results/issue18-dev3/summary.py > results/issue18-dev3/summary.txt
"""
import collections
import json
from pathlib import Path

HERE = Path(__file__).parent
for task in ("word", "distractors", "number"):
    path = HERE / task / "cells.jsonl"
    if not path.exists():
        continue
    c = collections.defaultdict(lambda: [0, 0])
    for line in path.read_text().splitlines():
        d = json.loads(line)
        c[d["method"].split("/")[-1]][0] += bool(d["hit"])
        c[d["method"].split("/")[-1]][1] += 1
    print(task + ": " + ", ".join(f"{m} {h}/{n}" for m, (h, n) in c.items()))
path = HERE / "fidelity" / "cells.jsonl"
if path.exists():
    kl = collections.defaultdict(list)
    for line in path.read_text().splitlines():
        d = json.loads(line)
        kl[(d["method"].split("/")[-1], d["budget"])].append(d["kl"])
    print("fidelity KL (mean over windows):")
    for (m, b), v in sorted(kl.items()):
        print(f"  {m} @ {b}: {sum(v) / len(v):.4f} ({len(v)} windows)")
