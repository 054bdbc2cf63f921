"""Dev data for issue 18 (session 5): reconstruction scores, prefill surprisal and sentence spans of
samples on Python's pydoc_data.topics (a haystack the PG grid does not use). One prefill + one
reconstruction pass per sample (the eval's own code), saved to a .pt per sample; the selection
variants are then compared offline (analyse.py) without running the model again.

    HF_HUB_OFFLINE=1 nice -n 5 python results/issue18-dev2/dump.py --length 1024 --samples 2 --out /tmp/h18dev
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
from kvcompress.eval.reconstruction import attach_reconstruction
from kvcompress.hf.loading import load_model
from kvcompress.hf.reconstruct import STATS_KEY

p = argparse.ArgumentParser()
p.add_argument("--length", type=int, default=1024)
p.add_argument("--samples", type=int, default=2)
p.add_argument("--seed", type=int, default=101)  # not the grid's seed 0 either
p.add_argument("--out", default="/tmp/h18dev")
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
    logits = rec.feed(prompt.head, logits=True)[0].float()
    snap = rec.snapshot()
    rec.close()
    ids = prompt.head[0]
    logp = logits.log_softmax(-1)
    surprisal = torch.zeros(ids.shape[0])
    surprisal[1:] = -logp[:-1].gather(-1, ids[1:, None])[:, 0]
    attach_reconstruction(model, tok, snap)
    scores = torch.stack([st.stats[STATS_KEY][0] for st in snap.states])  # [L, H, T]
    torch.save({"ids": ids, "scores": scores.half(), "surprisal": surprisal, "spans": spans,
                "task": s.task, "meta": s.meta, "context_offset": prompt.context_offset}, path)
    print(s.sample_id, f"{time.time() - t0:.1f}s", flush=True)
