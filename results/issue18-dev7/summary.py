"""Tables of results/issue18-dev7/*/rows.jsonl: hits per variant, and the guard's view of each sample.

    python results/issue18-dev7/summary.py [DIR ...]
"""
import glob
import json
import os
import sys

dirs = sys.argv[1:] or sorted(glob.glob(os.path.join(os.path.dirname(__file__), "*/")))
for d in dirs:
    path = os.path.join(d, "rows.jsonl")
    if not os.path.exists(path):
        continue
    rows = [json.loads(x) for x in open(path)]
    print(f"\n## {os.path.basename(d.rstrip('/'))} ({len({r['sample_id'] for r in rows})} samples)\n")
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    print("| variant | hits | value alone (all pairs) | value alone, copy heads | value alone, others | pairs with value whole |")
    print("|---|---|---|---|---|---|")
    for v in variants:
        rs = [r for r in rows if r["variant"] == v]
        hits = sum(r["hit"] for r in rs)
        hv = [r["heads"]["value"] for r in rs if r["heads"]]
        mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")
        cells = ([f"{mean([h['alone'] for h in hv]):.3f}", f"{mean([h['copy_alone'] or 0 for h in hv]):.2f}",
                  f"{mean([h['other_alone'] for h in hv]):.3f}", f"{mean([h['pairs_full'] for h in hv]):.1f}"]
                 if hv else ["", "", "", ""])
        print(f"| {v} | {hits}/{len(rs)} | " + " | ".join(cells) + " |")
    print("\n| sample | sentences | allowance (query part) | fact rank (pct) | tokens ranked ahead | median rank | "
          "surprisal rank | window-signal rank | chosen | value importance pct | copy pairs | fitted | hit variants |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        g = r["guard"]
        if not g:
            continue
        sid = r["sample_id"]
        hitv = ",".join(x["variant"] for x in rows if x["sample_id"] == sid and x["hit"])
        print(f"| {sid.split('-L')[1]} | {g['sentences']} | {g['allowance']} ({g['query_part']}) | {g['rank_score']} "
              f"({g['rank_pct']:.2f}) | {g['ahead_tokens']} | {g['median_rank']} | {g['surprisal_rank']} | "
              f"{g['rank_signal']} | {g['chosen']:.2f} | {g['value_importance_pct']:.2f} | "
              f"{' '.join(f'{l}.{h}' for l, h in g['copy_pairs'])} | {'hit' if r['hit'] else 'miss'} | {hitv} |")
