"""Session 29 dev tables: the copy_sentence_scale variants beside the presets in the copied run folders.

    python results/issue18-s29/dev_summary.py
"""

import json
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent


def short(method: str) -> str:
    return Path(method).stem if method.endswith(".json") else method


def main():
    for folder in sorted(p for p in HERE.iterdir() if p.is_dir() and p.name.startswith("dev-")):
        rows = [json.loads(line) for line in (folder / "cells.jsonl").read_text().splitlines()]
        print(f"### {folder.name}\n")
        if "fidelity" in folder.name or "agreement" in folder.name:
            metric = "kl" if "fidelity" in folder.name else "lcs"
            per = defaultdict(dict)
            for r in rows:
                if r["budget"] == 0.25 or r["method"] == "full":
                    per[short(r["method"])][r["sample_id"]] = r[metric]
            ids = sorted(per.get("kvzip-copy-heads-layers", {}))
            print(f"| method | mean {metric} @ 0.25 | per window |\n|---|---|---|")
            for m, v in per.items():
                if all(i in v for i in ids) and ids:
                    print(f"| {m} | {sum(v[i] for i in ids) / len(ids):.4f} | " + " ".join(f"{v[i]:.4f}" for i in ids) + " |")
        else:
            hits = defaultdict(list)
            for r in rows:
                hits[short(r["method"])].append(int(r["hit"]))
            print("| method | hits |\n|---|---|")
            for m, h in hits.items():
                print(f"| {m} | {sum(h)}/{len(h)} |")
        print()


if __name__ == "__main__":
    main()
