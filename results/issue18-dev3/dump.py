"""Dev data for issue 18 (session 6): as results/issue18-dev2/dump.py (pydoc_data.topics, seed 101,
never the PG grid's text or needles) plus the context tokens' surprisal under the reconstruction
pass (its own logits, teacher forced over the cache), beside the prefill's surprisal, so that
analyse.py can compare the two signals offline.

    HF_HUB_OFFLINE=1 nice -n 5 python results/issue18-dev3/dump.py --length 1024 --samples 2 --out /tmp/h18dev3
"""
import argparse
import os
import time

import torch

from kvcompress.eval.caches import Recorder
from kvcompress.eval.data import Haystack, token_span
from kvcompress.eval.facts import fact_samples
from kvcompress.eval.greedy import build_prompt
from kvcompress.eval.methods import Method
from kvcompress.eval.niah import niah_samples
from kvcompress.eval.reconstruction import QUERY_SAMPLES
from kvcompress.hf.loading import load_model
from kvcompress.hf.reconstruct import reconstruction_scores, repeat_prompt_ids

p = argparse.ArgumentParser()
p.add_argument("--length", type=int, default=1024)
p.add_argument("--samples", type=int, default=2)
p.add_argument("--seed", type=int, default=101)  # not the grid's seed 0 either
p.add_argument("--out", default="/tmp/h18dev3")
a = p.parse_args()
torch.set_num_threads(1)
os.makedirs(a.out, exist_ok=True)
model, tok = load_model(None)
hay = Haystack.load(None)  # pydoc_data.topics
depths = [0.1, 0.3, 0.5, 0.7, 0.9]
samples = (fact_samples(tok, hay, [a.length], depths, a.samples, "code-word", False, a.seed)
           + fact_samples(tok, hay, [a.length], depths, a.samples, "number", True, a.seed)
           + niah_samples(tok, hay, [a.length], depths, a.samples, "number", a.seed))
cfg = Method.parse("kvzip").config(0.25)
for s in samples:
    path = os.path.join(a.out, s.sample_id + ".pt")
    if os.path.exists(path):
        continue
    t0 = time.time()
    prompt = build_prompt(tok, s.context, s.question, None)
    spans = {k: token_span(prompt.offsets, v, shift=prompt.context_offset) for k, v in s.spans.items()}
    rec = Recorder.for_configs(model, tok, [cfg], backend="sdpa")
    t1 = time.time()
    logits = rec.feed(prompt.head, logits=True)[0].float()
    prefill_s = time.time() - t1
    snap = rec.snapshot()
    rec.close()
    ids = prompt.head[0]
    logp = logits.log_softmax(-1)
    surprisal = torch.zeros(ids.shape[0])
    surprisal[1:] = -logp[:-1].gather(-1, ids[1:, None])[:, 0]
    # the eval's pass (attach_reconstruction) with the pass's own surprisal asked for as well
    res = reconstruction_scores(model, snap.states, snap.token_ids, repeat_ids=repeat_prompt_ids(tok),
                                query_samples=QUERY_SAMPLES, surprisal=True)
    recon_s = res.seconds
    scores = torch.stack([x[0] for x in res.scores])  # [L, H, T]
    torch.save({"ids": ids, "scores": scores.half(), "surprisal": surprisal,
                "recon_surprisal": res.surprisal[0].clone(), "spans": spans,
                "task": s.task, "meta": s.meta, "context_offset": prompt.context_offset,
                "prefill_s": prefill_s, "reconstruct_s": recon_s}, path)
    print(s.sample_id, f"{time.time() - t0:.1f}s prefill {prefill_s:.1f}s pass {recon_s:.1f}s", flush=True)
