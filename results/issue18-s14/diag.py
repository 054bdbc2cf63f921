"""Issue 18, session 12: which part of kvzip-copy-heads-banded makes grid6's 4k fidelity window s1 lose at keep 0.5
(KL 0.0158 vs SnapKV 0.0086; one position predicting '\\n' with KL 0.999). Variants of the preset on the same
windows (fidelity-4k's code, samples 0-1), per-position KL recorded.

    python results/issue18-s12/diag.py OUT.json METHOD [METHOD ...]
"""
import json
import sys
import tempfile
from pathlib import Path

import torch

from kvcompress import cli
from kvcompress.eval import fidelity as F

KL = []
_compare = F.compare


def recording(ref_logits, logits, targets):
    ref = torch.log_softmax(ref_logits.double(), -1)
    cmp = torch.log_softmax(logits.double(), -1)
    KL.append(((ref.exp() * (ref - cmp)).sum(-1)).tolist())
    return _compare(ref_logits, logits, targets)


F.compare = recording
out_json, methods = sys.argv[1], sys.argv[2:]
prefix = int(__import__("os").environ.get("PREFIX", 4096))
samples = __import__("os").environ.get("SAMPLES", "2")
haystack = __import__("os").environ.get("HAYSTACK", "/work/shared/data/paul_graham_essays")
budgets = __import__("os").environ.get("BUDGETS", "0.5")
out = Path(tempfile.mkdtemp())
args = ["eval", "fidelity", "--prefix", str(prefix), "--continuation", "256", "--samples", samples, "--budgets",
        budgets, "--threads", "1", "--no-progress", "--no-plots", "--out", str(out)]
if haystack != "pydoc":  # default: Python's pydoc_data.topics (the dev text)
    args += ["--haystack", haystack]
for m in methods:
    args += ["--method", m]
cli.main(args)
cells = [json.loads(line) for line in open(out / "cells.jsonl")]
rows = []
for c, kl in zip(cells, KL):
    big = [k for k in kl if k > 0.1]
    rows.append({"method": c["method"], "sample": c["sample_id"], "budget": c["budget"], "kl": c["kl"],
                 "top1": c["top1"], "big": len(big), "big_share": sum(big) / max(sum(kl), 1e-12),
                 "budget_met": c["budget_met"], "per_position": kl})
    print(f"{c['method'][:90]:90s} {c['sample_id'][-3:]} {c['budget']} kl {c['kl']:.4f} top1 {c['top1']:.3f} "
          f">0.1: {len(big)}", flush=True)
json.dump(rows, open(out_json, "w"))
