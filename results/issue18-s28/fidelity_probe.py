"""Where in the continuation a compressed cache loses fidelity (session 28 dev tool, diagnosis only).

One fidelity window as the eval builds it (PG essays, prefix P, continuation C, seed, sample): per continuation
position, KL(full || compressed) for each method, and the positions where the methods differ most, with the
continuation's text around them and where in the prefix the same token run last appeared (a continuation that
copies the prefix needs those tokens kept).

    python results/issue18-s28/fidelity_probe.py --seed 19 --sample 0 --budget 0.25 \
        --methods "kvzip-copy-heads-noquery;snapkv;streamingllm" --out results/issue18-s28/probe-s19-w0.json
"""

import argparse
import json
import random

import torch

from kvcompress.eval.caches import Recorder
from kvcompress.eval.data import Haystack
from kvcompress.eval.fidelity import fidelity_windows, teacher_forced_logits
from kvcompress.eval.methods import Method
from kvcompress.eval.reconstruction import copy_for
from kvcompress.hf.loading import load_model

PG = "/work/shared/data/paul_graham_essays"


def per_position_kl(ref_logits, logits):
    ref = torch.log_softmax(ref_logits.double(), -1)
    cmp = torch.log_softmax(logits.double(), -1)
    return (ref.exp() * (ref - cmp)).sum(-1)  # [q]


def last_copy(prefix_ids, cont_ids, pos, span=4):
    """Start in the prefix of the last occurrence of the continuation's tokens [pos - span + 1, pos] (or None)."""
    lo = max(pos - span + 1, 0)
    run = cont_ids[lo:pos + 1]
    n = len(run)
    for start in range(len(prefix_ids) - n, -1, -1):
        if prefix_ids[start:start + n] == run:
            return start
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--sample", type=int, default=0)
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--continuation", type=int, default=256)
    ap.add_argument("--budget", type=float, default=0.25)
    ap.add_argument("--methods", default="kvzip-copy-heads-noquery;snapkv;streamingllm", help="methods separated by ;")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--out")
    a = ap.parse_args()
    torch.set_num_threads(1)
    model, tok = load_model()
    hay = Haystack.load(PG)
    windows = fidelity_windows(tok, hay, a.prefix, a.continuation, a.sample + 1, seed=a.seed)
    sid, ids = windows[a.sample]
    methods = [Method.parse(m) for m in a.methods.split(";")]
    configs = {m.label: m.config(a.budget) for m in methods}
    rec = Recorder.for_configs(model, tok, configs.values())
    try:
        rec.feed(ids[:, :a.prefix])
        snap = rec.snapshot()
        cont = ids[:, a.prefix:-1]
        ref_logits = rec.feed(cont, logits=True)[0].float()
    finally:
        rec.close()
    kls = {}
    for label, cfg in configs.items():
        copy = copy_for(model, tok, snap, cfg)
        copy.cache.enabled = False
        try:
            kls[label] = per_position_kl(ref_logits, teacher_forced_logits(model, copy.cache, cont, None))
        finally:
            copy.cache.close()
        print(f"{label}: KL mean {float(kls[label].mean()):.4f}", flush=True)
    labels = list(kls)
    first, second = labels[0], labels[1]
    gap = kls[first] - kls[second]
    prefix_ids = ids[0, :a.prefix].tolist()
    cont_ids = ids[0, a.prefix:].tolist()
    rows = []
    for pos in gap.argsort(descending=True)[: a.top].tolist():
        src = last_copy(prefix_ids, cont_ids, pos)
        rows.append({
            "pos": pos, **{lab: round(float(kls[lab][pos]), 3) for lab in labels},
            "context": tok.decode(cont_ids[max(pos - 12, 0): pos + 1]), "next": tok.decode(cont_ids[pos + 1: pos + 2]),
            "copied_from": src,
        })
        print(json.dumps(rows[-1]), flush=True)
    # how much of the gap sits in the top positions
    order = gap.argsort(descending=True)
    share = {k: round(float(gap[order[:k]].sum() / gap.sum()), 3) for k in (5, 10, 20, 50)}
    print("gap share in the top-k positions:", share)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"seed": a.seed, "sample": sid, "budget": a.budget, "methods": labels,
                       "kl_mean": {k: float(v.mean()) for k, v in kls.items()},
                       "kl": {k: [round(float(x), 4) for x in v] for k, v in kls.items()},
                       "top_gap": rows, "gap_share_top": share}, f, indent=1)


if __name__ == "__main__":
    main()
