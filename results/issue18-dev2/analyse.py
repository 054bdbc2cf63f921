"""Offline comparison of question-free sentence signals on the dev dumps (dump.py): for each
variant, the needle sentence's rank among the sentences and whether it fits the allowance a
preset gives it at keep 0.25. No model run; no digit or literal rule: every signal below is the
reconstruction pass's attention or the prefill's surprisal.

    python results/issue18-dev2/analyse.py /tmp/h18dev
"""
import glob
import json
import sys

import torch

from kvcompress.hf.loading import load_tokenizer
from kvcompress.hf.vocab import token_texts
from kvcompress.strategies.sentences import select_sentences, sentence_ids, sentence_sum

tok = load_tokenizer(None)
vocab = token_texts(tok)
files = sorted(glob.glob(sys.argv[1] + "/*.pt"))


def smean(x, sid, num):
    return sentence_sum(x, sid, num) / sentence_sum(torch.ones_like(x), sid, num).clamp(min=1)


def smax(x, sid, num):
    return x.new_zeros(x.shape[0], num).scatter_reduce_(-1, sid, x, "amax", include_self=True)


def per_head_sentence_max(S, sid, num):
    """[L*H, S]: each head's largest score inside each sentence."""
    LH = S.reshape(-1, S.shape[-1])
    return LH.new_zeros(LH.shape[0], num).scatter_reduce_(-1, sid[0].expand(LH.shape[0], -1), LH, "amax",
                                                          include_self=True)


def ranks01(x):
    """per row: rank percentile in [0, 1] (1 = best)."""
    r = x.argsort(-1).argsort(-1).float()
    return r / max(1, x.shape[-1] - 1)


def variants(S, sur, sid, num):
    L, H, T = S.shape
    tok_sum = S.sum((0, 1))[None]  # [1, T]
    norm = S / S.sum(-1, keepdim=True).clamp(min=1e-9)
    out = {
        "sum-mean (current)": smean(tok_sum, sid, num),
        "sum-sum": sentence_sum(tok_sum, sid, num),
        "sum-max": smax(tok_sum, sid, num),
        "norm-mean": smean(norm.sum((0, 1))[None], sid, num),
        "rank-mean": smean(ranks01(S.reshape(L * H, T)).mean(0)[None], sid, num),
        "logS-mean": smean(S.clamp(min=1e-6).log().mean((0, 1))[None], sid, num),
        "late-layers sum-mean": smean(S[L // 2:].sum((0, 1))[None], sid, num),
        "early-layers sum-mean": smean(S[: L // 2].sum((0, 1))[None], sid, num),
        "headmax-mean": per_head_sentence_max(S, sid, num).mean(0)[None],
        "headmax-rank": ranks01(per_head_sentence_max(S, sid, num)).mean(0)[None],
        "surprisal-mean": smean(sur[None], sid, num),
        "surprisal-max": smax(sur[None], sid, num),
    }
    # robust sentence statistics: a sentence's delimiter or first token can draw sink-like
    # attention from every query; the median / a trimmed mean are not moved by one such token
    med = torch.zeros(1, num)
    trim = torch.zeros(1, num)
    x = tok_sum[0]
    for s_ in range(num):
        v = x[sid[0] == s_]
        if v.numel():
            med[0, s_] = v.median()
            vs = v.sort().values
            trim[0, s_] = vs[:-1].mean() if v.numel() > 2 else vs.min()
    out["sum-median"] = med
    out["sum-trimmed"] = trim
    out["late-median"] = torch.zeros(1, num)
    xl = S[L // 2:].sum((0, 1))
    for s_ in range(num):
        v = xl[sid[0] == s_]
        if v.numel():
            out["late-median"][0, s_] = v.median()
    out["sum-median+surprisal"] = ranks01(med) + ranks01(out["surprisal-mean"])
    out["headmax-rank+surprisal"] = ranks01(out["headmax-rank"]) + ranks01(out["surprisal-mean"])
    out["sum-mean+surprisal"] = ranks01(out["sum-mean (current)"]) + ranks01(out["surprisal-mean"])
    return out


rows = {}
for f in files:
    d = torch.load(f)
    ids = d["ids"][None]
    T = ids.shape[1]
    S = d["scores"].float()
    sid = sentence_ids(ids, vocab)
    num = int(sid.max()) + 1
    a, b = d["spans"]["needle"]
    needle_sents = set(sid[0, a:b].tolist())
    lengths = sentence_sum(torch.ones(1, T), sid, num)
    for name, score in variants(S, d["surprisal"].float(), sid, num).items():
        score = score.clone()
        score[:, sid[0, :4].unique()] = -1  # sinks are kept anyway
        order = score[0].argsort(descending=True)
        rank = min(int((order == s).nonzero()[0, 0]) for s in needle_sents)
        res = {}
        for share, label in ((1.0, "all"), (0.5, "half"), (0.2, "fifth")):
            allowance = torch.tensor([int((T * 0.25 - 4) * share)])
            pos = score - score.min() + 1e-3
            chosen = select_sentences(pos, lengths, allowance)
            res[label] = all(bool(chosen[0, s]) for s in needle_sents if lengths[0, s] > 0)
        rows.setdefault(name, []).append((d["task"], rank, num, res))

tasks = sorted({t for v in rows.values() for t, *_ in v})
print(f"{len(files)} dev samples; needle sentence kept at keep 0.25 with the sentences given all / half / a fifth of the budget")
for name, v in rows.items():
    cells = []
    for t in tasks:
        vv = [x for x in v if x[0] == t]
        cells.append(f"{t[:18]}: " + "/".join(str(sum(r[lab] for *_, r in vv)) for lab in ("all", "half", "fifth"))
                     + f" of {len(vv)}, med rank {sorted(x[1] for x in vv)[len(vv) // 2]}")
    print(f"{name:26s} " + " | ".join(cells))
