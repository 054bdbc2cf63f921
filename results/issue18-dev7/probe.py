"""Why kvzip-copy-heads-fitted loses facts at 4k (issue 18, session 10; dev only: pydoc_data.topics).

Per sample (fact in the dev haystack, question after compression, keep 0.25): one prefill, one
reconstruction pass (+ surprisal), then
  - the guard's view (the preset's ImportanceGuard prepared exactly as the pipeline does): number of
    sentences, the allowance (tokens) and the query part, the fact sentence's rank under the
    question-free score (median importance + surprisal ranks) and under the window-query signal,
    the tokens of the sentences ranked ahead of it, whether it was chosen;
  - the needle's tokens' importance percentile among all tokens;
  - for each variant: the answer, hit, and per (layer, KV head) the share of the needle / value
    tokens kept alone (exact), split into the heads that keep sentences (copy heads) and the others.
One JSON row per (sample, variant) in OUT/rows.jsonl (resumable: finished samples are skipped).

    HF_HUB_OFFLINE=1 nice -n 5 python results/issue18-dev7/probe.py --length 4096 --fact code-word --out DIR
"""
import argparse
import json
import os
import time

import torch

from kvcompress.config import StrategySpec
from kvcompress.eval.caches import Recorder
from kvcompress.eval.data import Haystack, token_span
from kvcompress.eval.facts import fact_samples
from kvcompress.eval.greedy import build_prompt, greedy, stop_ids
from kvcompress.eval.methods import Method
from kvcompress.eval.reconstruction import attach_reconstruction, copy_for
from kvcompress.eval.scoring import score
from kvcompress.hf.loading import load_model
from kvcompress.pipeline import Pipeline
from kvcompress.strategies.importance import (copy_of, ranks01, sentence_median, surprisal_of, token_importance,
                                              window_signal)
from kvcompress.strategies.sentences import sentence_ids, sentence_sum

p = argparse.ArgumentParser()
p.add_argument("--length", type=int, default=4096)
p.add_argument("--fact", default="code-word")
p.add_argument("--distractors", action="store_true")
p.add_argument("--samples", type=int, default=2)
p.add_argument("--seed", type=int, default=101)
p.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9")
p.add_argument("--budget", type=float, default=0.25)
p.add_argument("--variants", default="all")
p.add_argument("--out", required=True)
p.add_argument("--snapshots", default=None, help="folder caching each sample's prefill + reconstruction pass "
               "(a later run with other variants compresses from it without the model passes; not committed)")
p.add_argument("--dump", default=None, help="folder for per-sample tensors (importance per layer/head/token, "
               "surprisal, sentence ids, window signal, copy scores): offline analysis, not committed")
a = p.parse_args()
torch.set_num_threads(1)
os.makedirs(a.out, exist_ok=True)
OUT = os.path.join(a.out, "rows.jsonl")

BASE = "kvzip-copy-heads-fitted"


def with_guard(cfg, **params):
    (g,) = cfg.guards
    return cfg.replace(guards=(StrategySpec(g.name, {**g.params, **params}),))


def variants(budget):
    base = Method.parse(BASE).config(budget)
    out = {
        "full": Method.parse("full").config(1.0),
        "fitted": base,
        "copy-heads": Method.parse("kvzip-copy-heads").config(budget),
        "mean-merger": base.replace(merger=StrategySpec("mean")),
        "evict": base.replace(clusterer=StrategySpec("d2o-similar", {**base.clusterer.params, "threshold": 1.0})),
        "copy0.1": with_guard(base, copy_heads=0.1),
        "copy0.2": with_guard(base, copy_heads=0.2),
        "qs0": with_guard(base, query_share=0.0),
        "qs0.5": with_guard(base, query_share=0.5),
        "banded": Method.parse("kvzip-copy-heads-banded").config(budget),
    }
    if a.variants != "all":
        out = {k: v for k, v in out.items() if k in a.variants.split(",")}
    return out


def guard_view(cfg, states, spans):
    """The preset's guard prepared as the pipeline prepares it, and the fact sentence's place in it."""
    pipe = Pipeline(cfg)
    first = states[0]
    budget = pipe._targets(first, None, None).amin(-1)
    T = first.num_tokens
    pos = torch.arange(T)[None, :]
    rel = pos - first.start()[:, None]
    already = (rel < cfg.sinks) | (pos >= T - cfg.recent) | (rel < 0)
    (guard,) = pipe.guards
    guard.prepare(states, budget, already)
    ids = first.token_ids[:, :T]
    sid = sentence_ids(ids, first.vocab, guard.ends)
    num = int(sid.max()) + 1
    imp = token_importance(states, T)
    free = (~already).float()
    lengths = sentence_sum(free, sid, num)
    med = sentence_median(imp, sid, num)
    sur = sentence_sum(surprisal_of(first, T), sid, num) / sentence_sum(torch.ones_like(imp), sid, num).clamp(min=1)
    eligible = lengths > 0
    score_ = ranks01(med, eligible) + guard.surprisal * ranks01(sur, eligible) + 1e-6 * eligible
    signal = window_signal(states, sid, num, already, guard.query_heads)
    a0, a1 = spans["needle"]
    v0, v1 = spans["value"]
    ns = sorted(set(sid[0, a0:a1].tolist()))
    vs = int(sid[0, (v0 + v1 - 1) // 2])
    s, L = score_[0], lengths[0]
    ahead = (s > s[vs]) & eligible[0]
    room = int((budget - already.sum(-1)).clamp(min=0)[0])
    allowance = int(guard._allowance[0])
    part = int(allowance * guard.query_share)
    pct = float((imp[0] < imp[0, v0:v1].mean()).float().mean())
    copy = torch.stack([copy_of(st)[0] for st in states])  # [L, H]
    copy_pairs = (copy >= guard._copy_thr[0]).nonzero().tolist() if guard._copy_thr is not None else []
    if a.dump:
        os.makedirs(a.dump, exist_ok=True)
        per_lht = torch.stack([st.stats["reconstruction"][0] for st in states]).half()  # [L, H, T]
        torch.save({"imp": imp[0], "per_lht": per_lht, "surprisal": surprisal_of(first, T)[0], "sid": sid[0],
                    "already": already[0], "signal": signal[0], "copy": torch.stack([copy_of(st)[0] for st in states]),
                    "spans": spans, "score": score_[0], "lengths": lengths[0], "allowance": allowance,
                    "keep": guard._keep[0]}, os.path.join(a.dump, f"{DUMP_ID}.pt"))
    return {
        "T": T, "sentences": num, "budget": int(budget[0]), "room": room, "allowance": allowance,
        "query_part": part, "needle_sentences": ns, "value_sentence": vs,
        "value_sentence_len": int(L[vs]),
        "rank_score": int(ahead.sum()), "rank_pct": round(float(ahead.sum()) / max(int(eligible[0].sum()), 1), 4),
        "ahead_tokens": int(L[ahead].sum()),
        "median_rank": int(((med[0] > med[0, vs]) & eligible[0]).sum()),
        "surprisal_rank": int(((sur[0] > sur[0, vs]) & eligible[0]).sum()),
        "rank_signal": int(((signal[0] > signal[0, vs]) & eligible[0]).sum()), "signal": float(signal[0, vs]),
        "chosen": float(guard._keep[0, v0:v1].float().mean()),
        "value_importance_pct": round(pct, 4), "copy_pairs": copy_pairs,
    }


def per_head(cache, span, copy_pairs_mask):
    """[L, H] share of the span's tokens kept alone; summarised for copy heads and the others."""
    a, b = span
    rows = []
    for i in cache.compressed_layer_ids():
        st = cache.layer_state(i)
        size = st.token_counts()
        alone = st.valid & (size < 1.5) & (st.positions >= a) & (st.positions < b)
        rows.append(alone.sum(-1)[0].float() / max(b - a, 1))
    m = torch.stack(rows)  # [L, H]
    cp = copy_pairs_mask[: m.shape[0]]
    return {
        "alone": round(float(m.mean()), 4),
        "copy_alone": round(float(m[cp].mean()), 4) if bool(cp.any()) else None,
        "other_alone": round(float(m[~cp].mean()), 4),
        "pairs_full": int((m > 0.999).sum()), "pairs_any": int((m > 0).sum()),
        "layers_full": [i for i in range(m.shape[0]) if bool((m[i] > 0.999).any())],
    }


done = set()
if os.path.exists(OUT):
    for line in open(OUT):
        r = json.loads(line)
        done.add((r["sample_id"], r["variant"]))

model, tok = load_model(None)
hay = Haystack.load(None)
depths = [float(x) for x in a.depths.split(",")]
samples = fact_samples(tok, hay, [a.length], depths, a.samples, a.fact, a.distractors, a.seed)
V = variants(a.budget)
stop = stop_ids(tok)
for smp in samples:
    todo = [k for k in V if (smp.sample_id, k) not in done]
    if not todo:
        continue
    t0 = time.perf_counter()
    prompt = build_prompt(tok, smp.context, smp.question, None)
    spans = {k: token_span(prompt.offsets, v, shift=prompt.context_offset) for k, v in smp.spans.items()}
    cached = a.snapshots and os.path.join(a.snapshots, f"{smp.sample_id}.pt")
    if cached and os.path.exists(cached):
        snap = torch.load(cached, weights_only=False)
        t1, rs = t0, 0.0
    else:
        rec = Recorder.for_configs(model, tok, list(V.values()))
        rec.feed(prompt.head)
        snap = rec.snapshot()
        rec.close()
        t1 = time.perf_counter()
        rs = attach_reconstruction(model, tok, snap, surprisal=True)
        if cached:
            os.makedirs(a.snapshots, exist_ok=True)
            torch.save(snap, cached)
    DUMP_ID = smp.sample_id
    view = guard_view(V.get("fitted", Method.parse(BASE).config(a.budget)), snap.states, spans)
    L, H = len(snap.states), snap.states[0].num_heads
    for k in todo:
        cfg = V[k]
        pipe_guards = cfg.guards
        cmask = torch.zeros(L, H, dtype=torch.bool)
        if pipe_guards:
            g = Pipeline(cfg).guards[0]
            if g.copy_heads < 1.0:
                copy = torch.stack([copy_of(st)[0] for st in snap.states])
                kk = int(round(g.copy_heads * copy.numel() + 0.4999))
                cmask = copy >= copy.flatten().topk(kk).values[-1]
        copy_ = copy_for(model, tok, snap, cfg, marks=spans)
        try:
            new, dec = greedy(model, copy_.cache, prompt.tail, smp.max_new_tokens, stop)
            heads = {n: per_head(copy_.cache, spans[n], cmask) for n in ("needle", "value")} if k != "full" else {}
        finally:
            copy_.cache.close()
        ans = tok.decode(new, skip_special_tokens=True).strip()
        sc = score(ans, list(smp.answers), smp.metric)
        row = {"sample_id": smp.sample_id, "variant": k, "length": a.length, "fact": a.fact,
               "distractors": a.distractors, **smp.meta, "answer": ans, "hit": sc["hit"],
               "keep_max": round(copy_.keep_max, 5), "trace": copy_.trace, "heads": heads,
               "copy_pairs_n": int(cmask.sum()), "guard": view if k == "fitted" else None,
               "prefill_s": round(t1 - t0, 1), "reconstruct_s": round(rs, 1), "compress_s": round(copy_.compress_s, 2),
               "load": os.getloadavg()[0], "time": time.strftime("%H:%M:%S")}
        with open(OUT, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(smp.sample_id, k, sc["hit"], ans[:40], flush=True)
