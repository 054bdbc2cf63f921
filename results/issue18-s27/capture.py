"""Capture, per eval window, what the importance guard reads (session 27 dev tool, diagnosis only).

For each (depth, sample) of one fact task this runs the preset's prefill and reconstruction pass as the eval does
and saves, before any compression: the token ids, the sentence ids, the needle's token span, the per-(layer, KV
head) reconstruction statistic [L, H, T], the copy scores [L, H], the prefill surprisal [T] and the guard's own
choice. Ranking signals can then be compared offline (rank.py) without rerunning the model.

    python results/issue18-s27/capture.py --kind code-word --seed 22 --out results/tmp/s27/word-s22.pt
"""

import argparse

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


def prefilled(model, tok, sample, cfg):
    """(prompt, spans in prompt tokens, snapshot of the prefilled context): the question comes after compression.
    Shared with session 30's hide_probe.py."""
    prompt = build_prompt(tok, sample.context, sample.question, None)
    spans = {n: token_span(prompt.offsets, s, shift=prompt.context_offset) for n, s in sample.spans.items()}
    rec = Recorder.for_configs(model, tok, [cfg])
    try:
        rec.feed(prompt.head)
        return prompt, spans, rec.snapshot()
    finally:
        rec.close()


def one(model, tok, hay, a, depth, sample_idx):
    if a.kind == "number" and not a.distractors:
        samples = niah_samples(tok, hay, [a.length], [depth], sample_idx + 1, kind="number", seed=a.seed)
    else:
        kind = "number" if a.kind in ("number-fact", "number") else a.kind
        samples = fact_samples(tok, hay, [a.length], [depth], sample_idx + 1, kind=kind,
                               distractors=a.distractors, seed=a.seed)
    sample = samples[sample_idx]
    cfg = get_preset(a.preset, keep_ratio=a.budget)
    prompt, spans, snap = prefilled(model, tok, sample, cfg)
    seen = {}
    real_importance = imp.token_importance

    def observed(states, num_tokens):
        if "rec" not in seen:
            seen["rec"] = torch.stack([imp.reconstruction_stat(st)[0] for st in states]).half()  # [L, H, T]
            seen["pos"] = states[0].positions[0, 0].clone()
            seen["copy"] = torch.stack([imp.copy_of(st)[0] for st in states])  # [L, H]
            seen["surprisal"] = imp.surprisal_of(states[0], num_tokens)[0].clone()
            seen["ids"] = states[0].token_ids[0, :num_tokens].clone()
            seen["vocab"] = states[0].vocab
        return real_importance(states, num_tokens)

    imp.token_importance = observed
    try:
        copy = copy_for(model, tok, snap, cfg, marks=spans)
    finally:
        imp.token_importance = real_importance
    guard = copy.cache.pipeline.guards[0]
    seen["guard_keep"] = guard._keep[0].clone()
    seen["needle"] = spans["needle"]
    seen["spans"] = spans
    seen["depth"], seen["sample"] = depth, sample_idx
    copy.cache.close()
    return seen


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kind", default="number", help="number (planted, niah) | code-word | number-fact")
    ap.add_argument("--distractors", action="store_true")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9")
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget", type=float, default=0.25)
    ap.add_argument("--preset", default="kvzip-copy-heads-noquery")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    model, tok = load_model()
    hay = Haystack(*load_haystack_text(PG))
    rows = []
    for depth in [float(d) for d in a.depths.split(",")]:
        for s in range(a.samples):
            rows.append(one(model, tok, hay, a, depth, s))
            print(f"done depth {depth} sample {s}", flush=True)
            vocab = rows[0]["vocab"]
            torch.save({"args": vars(a), "vocab": vocab,
                        "rows": [{k: v for k, v in r.items() if k != "vocab"} for r in rows]}, a.out)


if __name__ == "__main__":
    main()
