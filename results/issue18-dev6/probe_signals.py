"""Which window-query signal finds the fact sentence when the question is in the prompt, and what it
picks without it (issue 18, session 9; dev only: pydoc_data.topics, seed 101, 1k, number among
distractors). For each sample and protocol: the needle sentence's rank (0 = first) among the
candidate sentences under
  all      the sentences guard's query signal (all heads, layers >= 2)
  free     the same over the slots the guard may choose (not the sinks or the recent window)
  copyC    'free' in the top C share of (layer, KV head) pairs by the reconstruction copy score only
  far96    the session-8 probe's: sinks and the last 96 tokens left out

    HF_HUB_OFFLINE=1 nice -n 5 python results/issue18-dev6/probe_signals.py
"""
import argparse

import torch

from kvcompress.eval.caches import Recorder
from kvcompress.eval.data import Haystack, token_span
from kvcompress.eval.facts import fact_samples
from kvcompress.eval.greedy import build_prompt
from kvcompress.eval.methods import Method
from kvcompress.eval.reconstruction import attach_reconstruction
from kvcompress.hf.loading import load_model
from kvcompress.strategies.importance import copy_of
from kvcompress.strategies.sentences import _max_attention, _per_head_max, _slot_sentences, sentence_ids

p = argparse.ArgumentParser()
p.add_argument("--length", type=int, default=1024)
p.add_argument("--samples", type=int, default=2)
p.add_argument("--seed", type=int, default=101)
p.add_argument("--haystack", default=None)
p.add_argument("--preset", default="kvzip-copy-heads")
p.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9")
a = p.parse_args()
torch.set_num_threads(1)
model, tok = load_model(None)
hay = Haystack.load(a.haystack)
depths = [float(x) for x in a.depths.split(",")]
samples = fact_samples(tok, hay, [a.length], depths, a.samples, "number", True, a.seed)
cfg = Method.parse(a.preset).config(0.25)
SHARES = (0.05, 0.1, 0.25)
for s in samples:
    prompt = build_prompt(tok, s.context, s.question, None)
    spans = {k: token_span(prompt.offsets, v, shift=prompt.context_offset) for k, v in s.spans.items()}
    rec = Recorder.for_configs(model, tok, [cfg], backend="sdpa")
    rec.feed(prompt.head)
    snaps = {"agnostic": rec.snapshot()}
    rec.feed(prompt.tail[:, :-1])
    snaps["aware"] = rec.snapshot()
    rec.close()
    a0, a1 = spans["needle"]
    out = [s.sample_id]
    for proto, snap in snaps.items():
        attach_reconstruction(model, tok, snap, surprisal=True)
        ids = snap.token_ids
        sid = sentence_ids(ids, snap.vocab, (".", "!", "?", "\n"))
        num = int(sid.max()) + 1
        nsid = int(sid[0, (a0 + a1) // 2])
        sts = snap.states[2:]
        copy = torch.stack([copy_of(st)[0] for st in sts])  # [L', H]
        sig = {k: torch.zeros(num) for k in ["all", "free", "far96"] + [f"copy{c}" for c in SHARES]}
        for li, st in enumerate(sts):
            T = st.num_tokens
            m = _max_attention(st, st.extras["queries"])
            slot = _slot_sentences(st, sid)
            sig["all"] += _per_head_max(m, slot, num).sum(1)[0]
            free = m.masked_fill((st.positions < cfg.sinks) | (st.positions >= T - cfg.recent), 0.0)
            ph = _per_head_max(free, slot, num)[0]  # [H, S]
            sig["free"] += ph.sum(0)
            for c in SHARES:
                thr = copy.flatten().topk(max(1, int(round(c * copy.numel())))).values[-1]
                sig[f"copy{c}"] += (ph * (copy[li] >= thr)[:, None]).sum(0)
            far = m.masked_fill((st.positions < 4) | (st.positions >= T - 96), 0.0)
            sig["far96"] += _per_head_max(far, slot, num).sum(1)[0]
        ranks = " ".join(f"{k} {int((v > v[nsid]).sum())}" for k, v in sig.items())
        out.append(f"{proto}[{num}]: {ranks}")
    print(" | ".join(out), flush=True)
