"""Cost of the reconstruction pass as a ratio to the prefill, and cheaper variants beside it.

    cd /work/wt/h18 && HF_HUB_OFFLINE=1 python results/issue18-cost/measure.py --lengths 2048,4096 --reps 2

One process, interleaved (prefill, then each variant, per repetition), --threads 1, load average
recorded before and after. Quality of a variant = agreement with the full pass: share of the
full pass's top-25% slots (per layer and KV head) that the variant also ranks top-25%, and the
overlap (Jaccard) of the sentences the importance guard picks at keep 0.25.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="2048")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--haystack", default="/work/shared/data/paul_graham_essays")
    ap.add_argument("--out", default=str(Path(__file__).parent / "cost.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    from kvcompress.eval.caches import Recorder
    from kvcompress.eval.data import Haystack
    from kvcompress.eval.greedy import build_prompt
    from kvcompress.hf.loading import load_model
    from kvcompress.hf.reconstruct import reconstruction_scores, repeat_prompt_ids
    from kvcompress.strategies.importance import ImportanceGuard

    model, tok = load_model(None)
    L = model.config.num_hidden_layers
    hay = Haystack.load(args.haystack)
    variants = {
        "full (chunk 512)": dict(chunk=512),
        "subsample 0.5": dict(chunk=512, subsample=0.5),
        "subsample 0.25": dict(chunk=512, subsample=0.25),
        "first half of the layers": dict(chunk=512, layers=list(range(L // 2))),
        "subsample 0.5, first half": dict(chunk=512, subsample=0.5, layers=list(range(L // 2))),
    }
    rows = []
    load_before = os.getloadavg()
    for length in [int(x) for x in args.lengths.split(",")]:
        for rep in range(args.reps):
            text = hay.window(tok, length, random.Random(f"cost-{length}-{rep}"))
            prompt = build_prompt(tok, text, "What is this about?")
            rec = Recorder(model, tok, backend="sdpa")
            t0 = time.perf_counter()
            rec.feed(prompt.head)
            prefill_s = time.perf_counter() - t0
            snap = rec.snapshot()
            rec.close()
            repeat = repeat_prompt_ids(tok)
            ref = None
            for name, kw in variants.items():
                res = reconstruction_scores(model, snap.states, snap.token_ids, repeat_ids=repeat, **kw)
                row = {"length": length, "rep": rep, "tokens": int(snap.token_ids.shape[1]), "variant": name,
                       "params": kw if "layers" not in kw else {**kw, "layers": f"{kw['layers'][0]}..{kw['layers'][-1]}"},
                       "prefill_s": round(prefill_s, 3), "pass_s": round(res.seconds, 3),
                       "ratio": round(res.seconds / prefill_s, 3), "tokens_fed": res.tokens, "chunks": res.chunks}
                if ref is None:
                    ref = res
                else:
                    row.update(quality(ref, res, snap, tok))
                rows.append(row)
                print(json.dumps(row), flush=True)
    out = {"machine": {"cpus": os.cpu_count(), "torch_threads": 1, "load_before": load_before,
                       "load_after": os.getloadavg(), "note": "shared 2-core machine, six helpers running"},
           "model": "SmolLM2-135M-Instruct (GGUF Q4_1 de-quantized, float32)", "rows": rows}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


def quality(ref, res, snap, tok):
    from kvcompress.strategies.importance import ImportanceGuard

    overlaps = []
    for a, b in zip(ref.scores, res.scores):
        if a is None or b is None:
            continue
        k = max(1, a.shape[-1] // 4)
        ta = torch.zeros_like(a, dtype=torch.bool).scatter_(-1, a.topk(k, -1).indices, True)
        tb = torch.zeros_like(b, dtype=torch.bool).scatter_(-1, b.topk(k, -1).indices, True)
        overlaps.append(float((ta & tb).sum() / ta.sum()))
    T = snap.token_ids.shape[1]
    chosen = []
    for r in (ref, res):
        states = [st.replace(stats={"reconstruction": s}) for st, s in zip(snap.states, r.scores) if s is not None]
        g = ImportanceGuard(share=1.0)
        g.prepare(states, torch.tensor([T // 4]), torch.zeros(1, T, dtype=torch.bool))
        chosen.append(g.chosen_tokens()[0])
    a, b = chosen
    return {"top25_overlap": round(sum(overlaps) / len(overlaps), 4),
            "sentence_jaccard": round(float((a & b).sum() / (a | b).sum().clamp(min=1)), 4)}


if __name__ == "__main__":
    main()
