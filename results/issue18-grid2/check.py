"""The seeded cells left out and rerun in this grid (seed.py): do they reproduce session 5's?

    python results/issue18-grid2/check.py
"""
import json
from pathlib import Path

HERE = Path(__file__).parent
FIELDS = ("answer", "hit", "kl", "top1", "lcs", "lead", "keep_max")
for task in sorted(p.name for p in HERE.iterdir() if (p / "seeded-reruns.jsonl").exists()):
    new = {}
    for line in (HERE / task / "cells.jsonl").read_text().splitlines():
        r = json.loads(line)
        new[r["key"]] = r
    for line in (HERE / task / "seeded-reruns.jsonl").read_text().splitlines():
        old = json.loads(line)
        got = new.get(old["key"])
        if got is None:
            print(f"{task} {old['key']}: not rerun yet")
            continue
        diff = {f: (old[f], got[f]) for f in FIELDS if f in old and old[f] != got[f]
                and not (isinstance(old[f], float) and abs(old[f] - got[f]) <= 1e-6 * max(1.0, abs(old[f])))}
        print(f"{task} {old['key']}: " + ("same" if not diff else f"DIFFERS {diff}"))
