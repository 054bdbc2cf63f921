"""Does the reconstruction pass's copy score find the heads that retrieve the fact? (dev only:
pydoc_data.topics, seed 101, 1k tokens, the number among distractors; never the PG grid.)

Per sample: the full prompt (context, question, and the expected answer value teacher forced)
through an eager forward; the retrieval attention of a (layer, KV head) is the attention mass the
queries that predict the value's tokens put on the value's tokens in the context (mean over the
group's query heads and those queries). Beside it the head's copy score from the reconstruction
pass over the prefill. Prints the rank correlation over all (layer, head) pairs and the overlap of
the top quarter by copy score with the top heads by retrieval attention.

    HF_HUB_OFFLINE=1 nice -n 5 python results/issue18-dev4/heads.py [SAMPLES] > results/issue18-dev4/heads.txt
"""
import sys

import torch
import transformers

from kvcompress.eval.data import Haystack, token_span
from kvcompress.eval.facts import fact_samples
from kvcompress.eval.greedy import build_prompt
from kvcompress.hf.generate import cache_kwarg
from kvcompress.hf.loading import load_model
from kvcompress.hf.reconstruct import reconstruction_scores, repeat_prompt_ids

torch.set_num_threads(1)
model, tok = load_model(None)
model.set_attn_implementation("eager")
hay = Haystack.load(None)
samples = fact_samples(tok, hay, [1024], [0.1, 0.3, 0.5, 0.7, 0.9], 2, "number", True, 101)
samples = samples[: int(sys.argv[1]) if len(sys.argv) > 1 else len(samples)]
L, H = model.config.num_hidden_layers, model.config.num_key_value_heads
G = model.config.num_attention_heads // H


def spearman(a, b):
    ra = a.argsort().argsort().float()
    rb = b.argsort().argsort().float()
    return float(torch.corrcoef(torch.stack([ra, rb]))[0, 1])


rows = []
for s in samples:
    prompt = build_prompt(tok, s.context, s.question, None)
    lo, hi = token_span(prompt.offsets, s.spans["value"], shift=prompt.context_offset)
    hi = max(hi, lo + 1)
    head = prompt.head
    T = head.shape[1]
    value_ids = torch.tensor([tok(" " + s.meta["value"], add_special_tokens=False)["input_ids"]])
    ids = torch.cat([head, prompt.tail, value_ids], 1)
    with torch.no_grad():
        att = model(input_ids=ids, output_attentions=True).attentions
    q0 = T + prompt.tail.shape[1] - 1  # the last prompt token predicts the value's first token
    qrows = list(range(q0, q0 + value_ids.shape[1]))
    retr = torch.stack([a[0, :, qrows][:, :, lo:hi].sum(-1).mean(-1).view(H, G).mean(-1) for a in att])  # [L, H]
    cache = transformers.DynamicCache()
    with torch.no_grad():
        model(input_ids=head, use_cache=True, **{cache_kwarg(model): cache})
    kv = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    rec = reconstruction_scores(model, kv, head, repeat_ids=repeat_prompt_ids(tok))
    copy = torch.stack([c[0] for c in rec.copy])  # [L, H]
    rho = spearman(copy.flatten(), retr.flatten())
    k = L * H // 4
    top_copy = set(copy.flatten().topk(k).indices.tolist())
    top_retr = retr.flatten().topk(10).indices.tolist()
    share = sum(retr.flatten()[list(top_copy)]) / retr.flatten().sum()
    rows.append((rho, sum(i in top_copy for i in top_retr), float(share)))
    print(f"{s.sample_id}: spearman(copy, retrieval) {rho:.3f}; top-10 retrieval heads in the top quarter by copy: "
          f"{rows[-1][1]}/10; retrieval mass in the top quarter by copy: {share:.2f}; "
          f"top retrieval heads (layer, head): {[divmod(i, H) for i in top_retr[:5]]}; "
          f"top copy heads: {[divmod(i, H) for i in copy.flatten().topk(5).indices.tolist()]}", flush=True)
    if s is samples[0]:
        print("copy score per layer (KV heads):", [[round(float(x), 3) for x in r] for r in copy], flush=True)
        print("retrieval attention per layer:", [[round(float(x), 3) for x in r] for r in retr], flush=True)
n = len(rows)
print(f"mean over {n}: spearman {sum(r[0] for r in rows) / n:.3f}; top-10 retrieval in top-quarter copy "
      f"{sum(r[1] for r in rows) / n:.1f}/10 (chance 2.5); retrieval mass in top-quarter copy "
      f"{sum(r[2] for r in rows) / n:.2f} (chance 0.25)")
