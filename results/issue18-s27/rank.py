"""Offline comparison of sentence-ranking signals on captured windows (session 27 dev tool, see capture.py).

For every captured window and every signal: the needle sentence's place among the candidate sentences and whether
the guard's greedy choice (allowance as the noquery preset sizes it at keep 0.25) would hold it.

    python results/issue18-s27/rank.py results/tmp/s27/word-s22.pt results/tmp/s27/dis-s22.pt
"""

import sys

import torch

import kvcompress.strategies.importance as imp
from kvcompress.strategies.sentences import select_sentences, sentence_ids, sentence_sum

import os
SINKS, RECENT, BAND = 4, 32, 512
KEEP, SHARE = float(os.environ.get("KEEP", 0.25)), float(os.environ.get("SHARE", 0.8))


def per_sentence(x, sid, num, how):
    x = x[None]
    if how == "median":
        return imp.sentence_median(x, sid, num)[0]
    if how == "max":
        return x.new_zeros(1, num).scatter_reduce_(-1, sid, x, "amax", include_self=True)[0]
    s = sentence_sum(x, sid, num)
    if how == "sum":
        return s[0]
    return (s / sentence_sum(torch.ones_like(x), sid, num).clamp(min=1))[0]


def importance(rec, copy, free, heads=1.0, norm=False, layers=None):
    """[T]: rec [L, H, T] summed over the chosen (layer, head) pairs, band-relative."""
    r = rec.float()
    if layers is not None:
        r = r[layers]
        copy = copy[layers]
    if norm:  # each head's scores divided by that head's median over the free tokens
        med = r[..., free].median(-1, keepdim=True).values.clamp(min=1e-8)
        r = r / med
    if heads < 1.0:
        flat = copy.flatten()
        k = max(1, int(round(heads * flat.numel())))
        pick = (copy >= flat.topk(k).values[-1]).float()
        r = r * pick[..., None]
    x = r.sum((0, 1))
    return imp.band_relative(x[None], free[None], BAND)[0]


SIGNALS = {
    "preset": dict(),
    "imp-only": dict(sw=0.0),
    "sur-only": dict(iw=0.0),
    "sur2": dict(sw=2.0),
    "imp-mean": dict(ired="mean"),
    "sur-max": dict(sred="max"),
    "sur-median": dict(sred="median"),
    "heads25": dict(heads=0.25),
    "heads10": dict(heads=0.1),
    "norm": dict(norm=True),
    "norm-heads25": dict(norm=True, heads=0.25),
    "late-layers": dict(layers=slice(15, None)),
}


def evaluate(row, vocab, iw=1.0, sw=1.0, ired="median", sred="mean", heads=1.0, norm=False, layers=None):
    ids = row["ids"]
    T = ids.shape[0]
    sid = sentence_ids(ids[None], vocab, imp.SENTENCE_ENDS)[0]
    num = int(sid.max()) + 1
    free = torch.ones(T, dtype=torch.bool)
    free[:SINKS] = False
    free[T - RECENT:] = False
    lengths = sentence_sum(free.float()[None], sid[None], num)[0]
    eligible = lengths > 0
    x = importance(row["rec"], row["copy"], free, heads, norm, layers)
    score = iw * imp.ranks01(per_sentence(x, sid[None], num, ired)[None], eligible[None])[0]
    score = score + sw * imp.ranks01(per_sentence(row["surprisal"].float(), sid[None], num, sred)[None], eligible[None])[0]
    score = score + 1e-6 * eligible
    room = int(KEEP * T) - int((~free).sum())
    allowance = torch.tensor([int(room * SHARE)])
    chosen = select_sentences(score[None], lengths[None], allowance, eligible[None])[0]
    a0, a1 = row["needle"]
    ns = sid[a0:a1].unique()
    order = torch.where(eligible, score, float("-inf")).argsort(descending=True)
    place = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel()))
    return bool(chosen[ns].all()), int(place[ns].max()), int(chosen.sum())


def main(paths):
    data = [(p, torch.load(p, weights_only=False)) for p in paths]
    print(f"{'signal':14s}" + "".join(f"{p.split('/')[-1][:-3]:>16s}" for p, _ in data) + "   places")
    for name, kw in SIGNALS.items():
        line, places = f"{name:14s}", []
        for p, d in data:
            res = [evaluate(r, d["vocab"], **kw) for r in d["rows"]]
            line += f"{sum(c for c, _, _ in res):>12d}/{len(res):<3d}"
            places += [pl for _, pl, _ in res]
        print(line, "  ", places)


if __name__ == "__main__":
    main(sys.argv[1:])
