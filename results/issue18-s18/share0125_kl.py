"""refine_share 0.125 against the preset's 1.0: KL per window, paired (issue 14, session 18).
The 1.0 cells are results/issue18-seed3/fidelity-4k's kvzip-copy-heads-lead (main 24fe110: the library as
dce3317's); the 0.125 cells this directory's share0125-fidelity-4k (main dce3317), the same windows (--seed 3).
    python results/issue18-s18/share0125_kl.py      # table to stdout, share0125_kl.json beside it"""
import json
import statistics
from pathlib import Path

HERE = Path(__file__).parent
LEAD = "kvzip-copy-heads-lead"


def cells(path: Path, method: str) -> dict:
    out = {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        if r["method"] == method:
            out[(r["sample_id"], r["budget"])] = r
    return out


base = cells(HERE.parent / "issue18-seed3" / "fidelity-4k" / "cells.jsonl", LEAD)
new = cells(HERE / "share0125-fidelity-4k" / "cells.jsonl", f"{LEAD}:merger.refine_share=0.125")
snap = cells(HERE.parent / "issue18-seed3" / "fidelity-4k" / "cells.jsonl", "snapkv")
summary = {}
for budget in (0.5, 0.25):
    keys = sorted(k for k in new if k[1] == budget and k in base)
    d = [new[k]["kl"] - base[k]["kl"] for k in keys]
    if not keys:
        continue
    row = {"windows": len(keys), "kl_share_1.0": statistics.mean(base[k]["kl"] for k in keys),
           "kl_share_0.125": statistics.mean(new[k]["kl"] for k in keys),
           "kl_snapkv": statistics.mean(snap[k]["kl"] for k in keys),
           "diff_mean": statistics.mean(d), "higher/equal/lower": [sum(x > 0 for x in d), sum(x == 0 for x in d), sum(x < 0 for x in d)],
           "snapkv_minus_0.125": [snap[k]["kl"] - new[k]["kl"] for k in keys],
           "compress_s_1.0": statistics.mean(base[k]["compress_s"] for k in keys),
           "compress_s_0.125": statistics.mean(new[k]["compress_s"] for k in keys)}
    row["relative"] = row["diff_mean"] / row["kl_share_1.0"]
    summary[str(budget)] = row
    print(f"keep {budget}: {len(keys)} windows; KL share 1.0 {row['kl_share_1.0']:.5f}, 0.125 {row['kl_share_0.125']:.5f} "
          f"({100 * row['relative']:+.1f} %, higher/equal/lower {row['higher/equal/lower']}); SnapKV {row['kl_snapkv']:.5f}; "
          f"0.125 below SnapKV in {sum(x > 0 for x in row['snapkv_minus_0.125'])}/{len(keys)}")
(HERE / "share0125_kl.json").write_text(json.dumps(summary, indent=1))
