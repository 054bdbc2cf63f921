"""Where in the context the importance guard's chosen sentences sit (session 17 diagnosis of the depth-0.9 misses).

For one eval sample this runs a preset as the eval does and prints, per 512-token reconstruction band, the
sentences' mean importance rank (banded median reconstruction importance, in [0, 1]), mean surprisal rank, and the
share chosen by the ranking, with the needle's band marked; since session 18 also the needle's sentences' place in
the ranking (descending score among the eligible sentences) and the lowest score the ranking chose. Diagnosis only (the guard's calls observed through
wrappers installed for this run).

    python results/issue18-s17dev/band_profile.py --kind number --length 2048 --depth 0.9 --sample 0 --seed 0
"""

import argparse
import json

import torch

import kvcompress.strategies.importance as imp
from kvcompress.eval.caches import Recorder
from kvcompress.eval.data import Haystack, load_haystack_text, token_span
from kvcompress.eval.facts import fact_samples
from kvcompress.eval.greedy import build_prompt
from kvcompress.eval.niah import niah_samples
from kvcompress.eval.reconstruction import copy_for
from kvcompress.hf.loading import load_model
from kvcompress.presets import get_preset

PG = "/work/shared/data/paul_graham_essays"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kind", default="number", help="number (planted, niah) | code-word | number-fact")
    ap.add_argument("--distractors", action="store_true")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--depth", type=float, default=0.9)
    ap.add_argument("--sample", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget", type=float, default=0.25)
    ap.add_argument("--preset", default="kvzip-copy-heads-banded")
    a = ap.parse_args()
    torch.set_num_threads(1)
    model, tok = load_model()
    hay = Haystack(*load_haystack_text(PG))
    if a.kind == "number" and not a.distractors:
        samples = niah_samples(tok, hay, [a.length], [a.depth], a.sample + 1, kind="number", seed=a.seed)
    else:
        kind = "number" if a.kind in ("number-fact", "number") else a.kind
        samples = fact_samples(tok, hay, [a.length], [a.depth], a.sample + 1, kind=kind,
                               distractors=a.distractors, seed=a.seed)
    sample = samples[a.sample]
    prompt = build_prompt(tok, sample.context, sample.question, None)
    spans = {n: token_span(prompt.offsets, s, shift=prompt.context_offset) for n, s in sample.spans.items()}
    cfg = get_preset(a.preset, keep_ratio=a.budget)
    rec = Recorder.for_configs(model, tok, [cfg])
    try:
        rec.feed(prompt.head)
        snap = rec.snapshot()
    finally:
        rec.close()
    calls, ranked = [], []
    real_select, real_ranks = imp.select_sentences, imp.ranks01

    def observed(score, lengths, allowance, eligible):
        chosen = real_select(score, lengths, allowance, eligible)
        calls.append({"eligible": eligible.clone(), "chosen": chosen.clone(), "score": score.clone()})
        return chosen

    def observed_ranks(x, eligible):
        r = real_ranks(x, eligible)
        ranked.append(r.clone())
        return r

    raw = []
    real_importance = imp.token_importance

    def observed_importance(states, num_tokens):
        x = real_importance(states, num_tokens)
        raw.append(x.clone())
        return x

    imp.select_sentences, imp.ranks01, imp.token_importance = observed, observed_ranks, observed_importance
    try:
        copy = copy_for(model, tok, snap, cfg, marks=spans)
    finally:
        imp.select_sentences, imp.ranks01, imp.token_importance = real_select, real_ranks, real_importance
    guard = copy.cache.pipeline.guards[0]
    sid = imp.sentence_ids(guard._ids, snap.vocab, guard.ends)[0]  # [T]
    T = sid.shape[0]
    num = int(sid.max()) + 1
    start = torch.full((num,), T, dtype=torch.long).scatter_reduce_(0, sid, torch.arange(T), "amin")
    band = start // imp.RECONSTRUCTION_CHUNK
    a0, a1 = spans["needle"]
    needle_band = a0 // imp.RECONSTRUCTION_CHUNK
    elig, chosen = calls[-1]["eligible"][0], calls[-1]["chosen"][0]
    window_chosen = calls[0]["chosen"][0] if len(calls) > 1 else torch.zeros_like(chosen)
    imp_r, sur_r = ranked[0][0], ranked[1][0]
    rows = []
    for b in range(int(band.max()) + 1):
        m = (band == b) & elig
        n = int(m.sum())
        rows.append({"band": b, "needle": b == needle_band, "sentences": n,
                     "importance_rank01": round(float(imp_r[m].mean()), 3) if n else None,
                     "surprisal_rank01": round(float(sur_r[m].mean()), 3) if n else None,
                     "chosen_by_rank": round(float(chosen[m].float().mean()), 3) if n else None,
                     "chosen_by_window": int(window_chosen[(band == b)].sum())})
    # session 18: where the needle's sentences stand in the ranking (descending score among the eligible ones)
    score = calls[-1]["score"][0]
    order = torch.where(elig, score, float("-inf")).argsort(descending=True)
    place = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel()))
    picked = chosen & elig
    needle = []
    for i in sid[a0:a1].unique().tolist():
        needle.append({"sentence": i, "band": int(band[i]), "eligible": bool(elig[i]), "chosen": bool(chosen[i]),
                       "by_window": bool(window_chosen[i]), "importance_rank01": round(float(imp_r[i]), 3),
                       "surprisal_rank01": round(float(sur_r[i]), 3), "score": round(float(score[i]), 4),
                       "place": int(place[i]), "of": int(elig.sum())})
    # the token importance before the band division (summed over layers and heads): per band and the needle's
    x = raw[0][0].float()
    k = torch.arange(x.shape[0]) // imp.RECONSTRUCTION_CHUNK
    for row in rows:
        v = x[k == row["band"]]
        row["raw_median"] = round(float(v.median()), 4) if v.numel() else None
        row["raw_p90"] = round(float(v.quantile(0.9)), 4) if v.numel() else None
    raw_needle = {"median": round(float(x[a0:a1].median()), 4), "max": round(float(x[a0:a1].max()), 4)}
    out = {"sample": sample.sample_id, "seed": a.seed, "tokens": T, "needle_tokens": [a0, a1], "needle_raw": raw_needle,
           "kept_share_of_needle_tokens": float(guard._keep[0, a0:a1].float().mean()), "bands": rows,
           "needle_sentences": needle, "chosen_by_rank": int(picked.sum()),
           "lowest_chosen_score": round(float(score[picked].min()), 4) if bool(picked.any()) else None}
    copy.cache.close()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
