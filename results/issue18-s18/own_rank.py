"""Which reconstruction queries make the last band's tokens important (issue 18, session 18; diagnosis only).
Every chunk's queries sit at the same positions, right after the cache, so the context's last band is the nearest
text to every query of the pass, the repeat prompt's (fed again before every chunk) included. This runs
results/issue18-s17dev/band_profile.py on one sample (its arguments) with the pass's attention function wrapped to
also keep, per slot, the largest attention from (a) the chunk's own context queries only (not the repeat prompt's
or the lead-in's) and (b) those queries on the chunk's own slots only (its source text); then ranks the eligible
sentences as the guard does (banded median importance + surprisal rank) with each, and prints the needle's place.
    python results/issue18-s18/own_rank.py --preset kvzip-copy-heads-lead --kind number --depth 0.9 --sample 1 --seed 0"""
import contextlib
import io
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "issue18-s17dev"))
import band_profile  # noqa: E402
import kvcompress.hf.reconstruct as rc  # noqa: E402
import kvcompress.strategies.importance as imp  # noqa: E402

seen = {"own": {}, "src": {}}
real_call, real_importance, real_select, real_band = rc._Pass.__call__, imp.token_importance, imp.select_sentences, imp.band_relative


def call(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    idx = module.layer_idx
    if idx in self.scored:  # the chunk's own queries' attention on the cached slots, recomputed
        ck, _, bias, _ = self.layers[idx]
        B, Hq, q, D = query.shape
        H, N = ck.shape[1], ck.shape[2]
        G = Hq // H
        scale = 1.0 / D ** 0.5 if scaling is None else scaling
        qf = query.reshape(B, H, G * q, D).float()
        keys = torch.cat([ck.float(), key.float()], dim=2)
        logits = torch.matmul(qf, keys.transpose(-1, -2)).mul_(scale)
        causal = torch.ones(q, q, dtype=torch.bool).tril()
        mask = torch.cat([bias[:, :, None, :].expand(B, H, q, N),
                          torch.zeros(q, q).masked_fill(~causal, float("-inf")).expand(B, H, q, q)], dim=-1)
        p = logits.view(B, H, G, q, N + q).add_(mask[:, :, None]).softmax(-1)[..., :N]  # [B, H, G, q, N]
        own = p[:, :, :, self.prompt:].amax(dim=(2, 3))  # [B, H, N]
        m = q - self.prompt
        src = torch.zeros_like(own)
        src[..., self.start: self.start + m] = own[..., self.start: self.start + m]
        for name, x in (("own", own), ("src", src)):
            prev = seen[name].get(idx)
            seen[name][idx] = x if prev is None else torch.maximum(prev, x)
    return real_call(self, module, query, key, value, attention_mask, dropout, scaling, **kwargs)


def capture_importance(states, num_tokens):
    seen.setdefault("states", list(states))
    return real_importance(states, num_tokens)


def capture_select(score, lengths, allowance, eligible):
    seen.setdefault("selects", []).append(eligible.clone())
    return real_select(score, lengths, allowance, eligible)


def capture_band(x, free, band):
    seen.setdefault("free", free.clone())
    return real_band(x, free, band)


rc._Pass.__call__, imp.token_importance, imp.select_sentences, imp.band_relative = (
    call, capture_importance, capture_select, capture_band)
buf = io.StringIO()
with contextlib.redirect_stdout(buf):
    band_profile.main()
rc._Pass.__call__, imp.token_importance, imp.select_sentences, imp.band_relative = (
    real_call, real_importance, real_select, real_band)
profile = json.loads(buf.getvalue()[buf.getvalue().index("{"):])
states = seen["states"]
a0, a1 = profile["needle_tokens"]
T = states[0].num_tokens
sid = imp.sentence_ids(states[0].token_ids[:, :T], states[0].vocab, imp.SENTENCE_ENDS)[0]
num = int(sid.max()) + 1
elig = seen["selects"][-1]
free = seen["free"]
surprise = imp.surprisal_of(states[0], T)
ones = torch.ones(1, T)
sur = imp.sentence_sum(surprise, sid[None], num) / imp.sentence_sum(ones, sid[None], num).clamp(min=1)
needle = sid[a0:a1].unique().tolist()
out = {"sample": profile["sample"], "needle_tokens": [a0, a1], "preset_place": profile["needle_sentences"], "variants": {}}
for name in ("all", "own", "src"):
    x = torch.zeros(1, T)
    for layer, st in enumerate(states):
        r = imp.reconstruction_stat(st) if name == "all" else seen[name][layer]
        r = r.masked_fill(~st.valid, 0.0)
        x.scatter_add_(1, st.positions.clamp(0, T - 1).flatten(1), (r * (st.positions >= 0)).flatten(1))
    rel = real_band(x, free, imp.RECONSTRUCTION_CHUNK)
    s = imp.sentence_median(rel, sid[None], num)
    total = imp.ranks01(s, elig) + imp.ranks01(sur, elig)
    order = torch.where(elig[0], total[0], float("-inf")).argsort(descending=True)
    place = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel()))
    k = torch.arange(T) // imp.RECONSTRUCTION_CHUNK
    out["variants"][name] = {
        "needle": [{"place": int(place[i]), "importance_rank01": round(float(imp.ranks01(s, elig)[0, i]), 3)} for i in needle],
        "of": int(elig.sum()), "needle_raw_median": round(float(x[0, a0:a1].median()), 4),
        "band_raw_medians": [round(float(x[0][k == b].median()), 4) for b in range(int(k[-1]) + 1)]}
print(json.dumps(out, indent=1))
