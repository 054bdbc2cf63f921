"""Why the copy-heads layout loses the fact with the question inside the prompt (issue 18, session 8).
For each number-among-distractors sample (dev: pydoc_data.topics, seed 101, 1k; or --haystack), in
both protocols: the needle sentence's rank among the candidate sentences by the guard's question-free
score (median importance + prefill surprisal), by the window queries' attention (query signal), and
whether the guard's allowance takes it.

    HF_HUB_OFFLINE=1 nice -n 5 python results/issue18-dev5/probe_aware.py [--haystack DIR --seed 0 --length 2048]
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
from kvcompress.pipeline import Pipeline
from kvcompress.strategies.sentences import _max_attention, _per_head_max, _slot_sentences, query_signal, sentence_ids

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
        pipe = Pipeline(cfg)
        pipe.prepare(snap.states)
        g = pipe.guards[0]
        chosen = g.chosen_tokens()[0]
        ids = snap.token_ids
        sid = sentence_ids(ids, snap.vocab, g.ends)
        num = int(sid.max()) + 1
        nsid = int(sid[0, (a0 + a1) // 2])
        qs = query_signal(snap.states, sid, num)[0]
        qrank = int((qs > qs[nsid]).sum())
        # the same without the sinks' slots (the first 4 tokens draw sink attention from every query)
        qn = torch.zeros(num)
        for st in snap.states[2:]:
            m = _max_attention(st, st.extras["queries"]).masked_fill((st.positions < 4) | (st.positions >= st.num_tokens - 96), 0.0)
            qn += _per_head_max(m, _slot_sentences(st, sid), num).sum(1)[0]
        nrank = int((qn > qn[nsid]).sum())
        top = qn.argsort(descending=True)[:3].tolist()
        out.append(f"{proto}: chosen {chosen[a0:a1].float().mean():.2f} q-rank {qrank}/{num} "
                   f"(q {qs[nsid]:.2f}, top {qs.max():.2f}) no-sink rank {nrank} top3 {top} needle {nsid}")
    print(" | ".join(out), flush=True)
