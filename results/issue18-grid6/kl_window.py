"""Where the 4k / keep-0.5 KL of grid6's fidelity window 1 comes from: per-position KL of SnapKV, StreamingLLM and
kvzip-copy-heads-banded on that window (the same window and code as fidelity-4k), the top positions with the token
fed, the target and each method's top token against the full cache's.

    python results/issue18-grid6/kl_window.py > results/issue18-grid6/kl_window.md
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
    KL.append(((ref.exp() * (ref - cmp)).sum(-1), ref.argmax(-1), cmp.argmax(-1), targets))
    return _compare(ref_logits, logits, targets)


F.compare = recording
out = Path(tempfile.mkdtemp())
methods = "snapkv,streamingllm,kvzip-copy-heads-banded"
cli.main(["eval", "fidelity", "--prefix", "4096", "--continuation", "256", "--samples", "2", "--budgets", "0.5",
          "--presets", methods, "--threads", "1", "--no-progress", "--no-plots",
          "--haystack", "/work/shared/data/paul_graham_essays", "--out", str(out)])
cells = [json.loads(line) for line in open(out / "cells.jsonl")]
from kvcompress.hf.loading import load_model  # noqa: E402
_, tok = load_model()
rows = [(c, k) for c, k in zip(cells, KL) if c["sample_id"].endswith("s1")]
print("| method | KL mean | KL max | positions with KL > 0.1 | their share of the mean |")
print("|---|---|---|---|---|")
for c, (kl, *_ ) in rows:
    big = kl > 0.1
    print(f"| {c['method']} | {kl.mean():.4f} | {kl.max():.3f} | {int(big.sum())} | {float(kl[big].sum() / kl.sum()):.2f} |")
kl0, ref_top, _, targets = rows[-1][1]
top = kl0.topk(5).indices.tolist()
print("\nTop positions of kvzip-copy-heads-banded (position in the continuation: target | full's top | each method's "
      "top, KL)\n")
for p in top:
    ctx = tok.decode(targets[max(0, p - 12):p].tolist()).replace("\n", " ")
    line = f"- {p}: ...{ctx!r} -> target {tok.decode([int(targets[p])])!r}, full {tok.decode([int(ref_top[p])])!r}"
    for c, (kl, _, cmp_top, _) in rows:
        line += f"; {c['method']} {tok.decode([int(cmp_top[p])])!r} {float(kl[p]):.3f}"
    print(line)
