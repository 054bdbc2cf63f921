"""Where the importance guard of kvzip-copy-heads-banded ranks a fact's sentence (session 16 diagnosis).

The preset misses facts at the same depths on every seed while the full cache answers (4k: depth 0.5 in 4 of 4
samples with distractors; 2k: depth 0.9 in 5 samples over the three facts). For one sample this prints, from the
guard's own decision, whether the needle sentence was chosen (by the window signal or by the ranking), its rank
among the sentences, the allowance, and the band each of its tokens falls in. Diagnosis only: the library is
used as is; the guard's two select_sentences calls are observed through a wrapper installed for this run.

    python results/issue18-s16dev/needle_rank.py --kind number --distractors --length 2048 --depth 0.9 --sample 0 --seed 0
"""

import argparse
import json

import torch

import kvcompress.strategies.importance as imp
from kvcompress.eval.caches import Recorder, compressed_copy
from kvcompress.eval.data import Haystack, load_haystack_text, token_span
from kvcompress.eval.facts import fact_samples
from kvcompress.eval.greedy import build_prompt
from kvcompress.eval.niah import niah_samples
from kvcompress.eval.reconstruction import attach_reconstruction, copy_for
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
    ap.add_argument("--chunk", type=int, default=0, help="reconstruction chunk (and the guard's band); 0: the default")
    ap.add_argument("--lead", type=int, default=0, help="the pass's lead-in before each chunk (reconstruction_scores)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    model, tok = load_model()
    hay = Haystack(*load_haystack_text(PG))
    if a.kind == "number" and not a.distractors:
        samples = niah_samples(tok, hay, [a.length], [a.depth], a.sample + 1, kind="number", seed=a.seed)
    else:
        kind = "number" if a.kind == "number-fact" or a.kind == "number" else a.kind
        samples = fact_samples(tok, hay, [a.length], [a.depth], a.sample + 1, kind=kind,
                               distractors=a.distractors, seed=a.seed)
    sample = samples[a.sample]
    prompt = build_prompt(tok, sample.context, sample.question, None)
    spans = {n: token_span(prompt.offsets, s, shift=prompt.context_offset) for n, s in sample.spans.items()}
    cfg = get_preset(a.preset, keep_ratio=a.budget)
    if a.chunk:
        (g,) = cfg.guards
        cfg = cfg.replace(guards=({"name": g.name, "params": {**g.params, "band": a.chunk}},))
    rec = Recorder.for_configs(model, tok, [cfg])
    try:
        rec.feed(prompt.head)
        snap = rec.snapshot()
    finally:
        rec.close()

    calls = []
    real = imp.select_sentences

    def observed(score, lengths, allowance, eligible):
        chosen = real(score, lengths, allowance, eligible)
        calls.append({"score": score.clone(), "lengths": lengths.clone(), "allowance": allowance.clone(),
                      "eligible": eligible.clone(), "chosen": chosen.clone()})
        return chosen

    ranked = []
    real_ranks = imp.ranks01

    def observed_ranks(x, eligible):
        r = real_ranks(x, eligible)
        ranked.append(r.clone())
        return r

    imp.select_sentences, imp.ranks01 = observed, observed_ranks
    try:
        if a.chunk or a.lead:  # the pass with other chunks or a lead-in, attached before the copy
            attach_reconstruction(model, tok, snap, chunk=a.chunk or imp.RECONSTRUCTION_CHUNK, lead=a.lead,
                                  surprisal=True)
            copy = compressed_copy(model, snap, cfg, marks=spans)
        else:
            copy = copy_for(model, tok, snap, cfg, marks=spans)
    finally:
        imp.select_sentences, imp.ranks01 = real, real_ranks
    guard = copy.cache.pipeline.guards[0]
    ids = guard._ids[0]
    sid = imp.sentence_ids(guard._ids, snap.vocab, guard.ends)[0]
    a0, a1 = spans["needle"]
    needle_sids = sorted(set(sid[a0:a1].tolist()))
    out = {"sample": sample.sample_id, "seed": a.seed, "needle_tokens": [a0, a1], "value_tokens": list(spans["value"]),
           "tokens": int(ids.shape[0]), "needle_sentences": needle_sids,
           "bands_of_needle": sorted(set((torch.arange(a0, a1) // imp.RECONSTRUCTION_CHUNK).tolist())),
           "kept_share_of_needle_tokens": float(guard._keep[0, a0:a1].float().mean()), "calls": []}
    for name, c in zip(("window", "ranking"), calls):
        score, elig = c["score"][0], c["eligible"][0]
        order = torch.argsort(torch.where(elig, score, float("-inf")), descending=True)
        rank = {int(s): int(r) for r, s in enumerate(order.tolist())}
        out["calls"].append({"by": name, "allowance_tokens": int(c["allowance"][0]),
                             "eligible_sentences": int(elig.sum()), "chosen_sentences": int(c["chosen"][0].sum()),
                             "chosen_tokens": int((c["lengths"][0] * c["chosen"][0]).sum()),
                             "needle": [{"sentence": s, "eligible": bool(elig[s]), "score": float(score[s]),
                                         "rank": rank.get(s), "chosen": bool(c["chosen"][0, s]),
                                         "tokens": float(c["lengths"][0, s])} for s in needle_sids]})
    # the ranking's two terms (ranks01 of the banded median importance, then of the mean surprisal), in [0, 1]
    for name, r in zip(("importance_rank01", "surprisal_rank01"), ranked[:2]):
        out[name] = [round(float(r[0, s]), 3) for s in needle_sids]
    out["trace"] = {k: {kk: vv for kk, vv in v.items() if kk != "alone_per_layer"} for k, v in copy.trace.items()}
    copy.cache.close()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
