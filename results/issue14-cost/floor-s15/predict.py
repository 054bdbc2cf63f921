"""Predicted fit shares of the 8k prefill (issue 14, session 15): cost-s14-main.json's share x the interleaved
ratios of the ab3 runs given (new / old, median of the repeats), per preset and budget.
    python results/issue14-cost/floor-s15/predict.py AB.txt [AB2.txt ...]  (several files: the ratios multiply)"""
import json, re, sys
shares = {k.split(":")[0]: v["fit_share_of_prefill"] for k, v in json.load(open("results/issue14-cost/cost-s14-main.json"))["summary"].items()}
ratios = {}
for path in sys.argv[1:]:
    for line in open(path):
        m = re.match(r"(\S+?)(@refine=\d+)?: ms/layer .*ratio median ([\d.]+).* win ([\d.e+-]+)/([\d.e+-]+)", line)
        if m:
            k = m.group(1)
            r, e = ratios.get(k, (1.0, 1.0))
            ratios[k] = (r * float(m.group(3)), e * float(m.group(4)) / float(m.group(5)))
out = {}
for k, s in shares.items():
    r, e = ratios.get(k, (None, None))
    out[k] = {"share_s14": s, "ratio": r, "predicted_share": s * r if r else None, "win_error_ratio": e}
    print(f"| {k} | {100 * s:.2f} % | {r:.3f} | {100 * s * r:.2f} % | {e:.3f} |" if r else f"| {k} | {100 * s:.2f} % | - | - | - |")
