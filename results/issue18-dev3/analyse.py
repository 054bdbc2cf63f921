"""Offline comparison on the dev dumps of results/issue18-dev3/dump.py (pydoc_data.topics): which
surprisal, the prefill's or the reconstruction pass's, adds to the sentences' median reconstruction
importance. For each variant: the needle sentence's median rank, and whether it fits the allowance
at keep 0.25 with the sentences given all / half / a fifth of the budget. No model run; no digit or
literal rule.

    python results/issue18-dev3/analyse.py /tmp/h18dev3
"""
import glob
import sys

import torch

from kvcompress.hf.loading import load_tokenizer
from kvcompress.hf.vocab import token_texts
from kvcompress.strategies.importance import sentence_median
from kvcompress.strategies.sentences import select_sentences, sentence_ids, sentence_sum

tok = load_tokenizer(None)
vocab = token_texts(tok)
files = sorted(glob.glob(sys.argv[1] + "/*.pt"))


def smean(x, sid, num):
    return sentence_sum(x, sid, num) / sentence_sum(torch.ones_like(x), sid, num).clamp(min=1)


def ranks01(x):
    r = x.argsort(-1).argsort(-1).float()
    return r / max(1, x.shape[-1] - 1)


def variants(S, sur_pre, sur_rec, sid, num):
    tok_sum = S.sum((0, 1))[None]
    med = sentence_median(tok_sum, sid, num)
    pre_mean, rec_mean = smean(sur_pre[None], sid, num), smean(sur_rec[None], sid, num)
    pre_med, rec_med = sentence_median(sur_pre[None], sid, num), sentence_median(sur_rec[None], sid, num)
    out = {
        "median importance": med,
        "prefill surprisal mean": pre_mean,
        "pass surprisal mean": rec_mean,
        "pass surprisal median": rec_med,
        "median + prefill sur mean": ranks01(med) + ranks01(pre_mean),
        "median + prefill sur median": ranks01(med) + ranks01(pre_med),
        "median + pass sur mean": ranks01(med) + ranks01(rec_mean),
        "median + pass sur median": ranks01(med) + ranks01(rec_med),
        "median + 0.5 pass sur mean": ranks01(med) + 0.5 * ranks01(rec_mean),
        "median + 0.5 prefill sur mean": ranks01(med) + 0.5 * ranks01(pre_mean),
    }
    return out


rows = {}
corr = []
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
    sp, sr = d["surprisal"].float(), d["recon_surprisal"].float()
    c = torch.corrcoef(torch.stack([sp[1:], sr[1:]]))[0, 1]
    corr.append(float(c))
    for name, score in variants(S, sp, sr, sid, num).items():
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
print(f"token-level correlation prefill vs pass surprisal: mean {sum(corr) / len(corr):.3f}")
for name, v in rows.items():
    cells = []
    for t in tasks:
        vv = [x for x in v if x[0] == t]
        cells.append(f"{t[:18]}: " + "/".join(str(sum(r[lab] for *_, r in vv)) for lab in ("all", "half", "fifth"))
                     + f" of {len(vv)}, med rank {sorted(x[1] for x in vv)[len(vv) // 2]}")
    print(f"{name:30s} " + " | ".join(cells))
