"""Where the needle's sentence would rank if the guard's token importance were summed over the heads that copy only
(issue 18, session 18; diagnosis only). Runs results/issue18-s17dev/band_profile.py on one sample (its arguments),
captures the states the importance guard prepares from, and ranks the eligible sentences by the median of each
token's importance summed over the (layer, KV head) pairs in the top q of copy scores (q = 1: every head, the
preset's signal), band-relative by median division or by rank, with the preset's surprisal rank added; prints the
needle sentence's place for each (q, norm) as JSON.
    python results/issue18-s18/copy_rank.py --preset kvzip-copy-heads-lead --kind number --depth 0.9 --sample 1 --seed 0"""
import contextlib
import io
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "issue18-s17dev"))
import band_profile  # noqa: E402
import kvcompress.strategies.importance as imp  # noqa: E402

seen = {}
real_importance, real_select, real_band = imp.token_importance, imp.select_sentences, imp.band_relative


def capture_importance(states, num_tokens):
    seen.setdefault("states", list(states))
    return real_importance(states, num_tokens)


def capture_select(score, lengths, allowance, eligible):
    seen.setdefault("selects", []).append((score.clone(), lengths.clone(), allowance.clone(), eligible.clone()))
    return real_select(score, lengths, allowance, eligible)


def capture_band(x, free, band):
    seen.setdefault("free", free.clone())
    return real_band(x, free, band)


def band_rank(x, free, band):
    """[B, T]: each free token's rank by x among the free tokens of its band, as a share in (0, 1] (ties by
    position); 0 for the tokens not free (a monotone-drift-free alternative to band_relative's division)."""
    B, T = x.shape
    k = torch.arange(T) // band
    nb = int(k[-1]) + 1
    group = torch.where(free, k[None, :].expand(B, T), nb)
    by_value = x.argsort(dim=-1, stable=True)
    order = by_value.gather(-1, group.gather(-1, by_value).argsort(dim=-1, stable=True))
    counts = torch.zeros(B, nb + 1, dtype=torch.long).scatter_add_(-1, group, torch.ones_like(group))
    g = group.gather(-1, order)
    place = torch.arange(T)[None, :] - (counts.cumsum(-1) - counts).gather(-1, g)
    out = torch.zeros_like(x).scatter_(-1, order, (place + 1).to(x.dtype) / counts.gather(-1, g).to(x.dtype))
    return torch.where(free, out, torch.zeros(()))


imp.token_importance, imp.select_sentences, imp.band_relative = capture_importance, capture_select, capture_band
buf = io.StringIO()
with contextlib.redirect_stdout(buf):
    band_profile.main()
imp.token_importance, imp.select_sentences, imp.band_relative = real_importance, real_select, real_band
profile = json.loads(buf.getvalue()[buf.getvalue().index("{"):])
states = seen["states"]
a0, a1 = profile["needle_tokens"]
T = states[0].num_tokens
ids = states[0].token_ids[:, :T]
sid = imp.sentence_ids(ids, states[0].vocab, imp.SENTENCE_ENDS)[0]
num = int(sid.max()) + 1
score0, lengths, allowance, eligible = seen["selects"][-1]  # the ranking's own call (after the window's)
elig = eligible[0]
copy = torch.stack([imp.copy_of(st) for st in states], 1)[0]  # [L, H]
free = seen["free"]  # the guard's: not the sinks or the recent window
surprise = imp.surprisal_of(states[0], T)[0]
sur = imp.sentence_sum(surprise[None], sid[None], num) / imp.sentence_sum(torch.ones(1, T), sid[None], num).clamp(min=1)
out = {"sample": profile["sample"], "needle_tokens": [a0, a1], "preset_place": profile["needle_sentences"], "variants": []}
needle = sid[a0:a1].unique()
for q in (1.0, 0.5, 0.2, 0.1, 0.05):
    k = max(1, int(round(q * copy.numel())))
    thr = copy.flatten().topk(k).values[-1]
    x = torch.zeros(1, T)
    for layer, st in enumerate(states):
        use = (copy[layer] >= thr).float()[None, :, None]  # [1, H, 1]
        r = imp.reconstruction_stat(st).masked_fill(~st.valid, 0.0) * use
        x.scatter_add_(1, st.positions.clamp(0, T - 1).flatten(1), (r * (st.positions >= 0)).flatten(1))
    for norm in ("median", "rank"):
        rel = (band_rank if norm == "rank" else real_band)(x, free, imp.RECONSTRUCTION_CHUNK)
        s = imp.sentence_median(rel, sid[None], num)
        e = elig[None]
        total = imp.ranks01(s, e) + imp.ranks01(sur, e)
        order = torch.where(e[0], total[0], float("-inf")).argsort(descending=True)
        place = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel()))
        out["variants"].append({"copy_heads": q, "norm": norm, "needle": [
            {"place": int(place[i]), "importance_rank01": round(float(imp.ranks01(s, e)[0, i]), 3)} for i in needle.tolist()],
            "of": int(e.sum())})
print(json.dumps(out, indent=1))
