"""Capture SmolLM2's per-layer rotated queries, keys and values over fidelity windows (offline study).

    python results/issue14-offline/capture.py --haystack /work/shared/data/paul_graham_essays --out /tmp/h14/pg.pt
Writes {"windows": [{"q": [L, Hq, T, D], "k": [L, H, T, D], "v": ..., "ids": [T]}], "scale": s}.
"""
import argparse, sys, torch
sys.path.insert(0, ".")
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from kvcompress.hf.loading import load_model
from kvcompress.eval.data import Haystack
from kvcompress.eval.fidelity import fidelity_windows

p = argparse.ArgumentParser()
p.add_argument("--haystack", default=None)
p.add_argument("--prefix", type=int, default=1000)
p.add_argument("--continuation", type=int, default=500)
p.add_argument("--samples", type=int, default=2)
p.add_argument("--out", required=True)
a = p.parse_args()
torch.set_num_threads(1)
model, tok = load_model()
rec = {}
def recording(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kw):
    rec.setdefault("scale", scaling)
    rec.setdefault("layers", []).append((query[0].clone(), key[0].clone(), value[0].clone()))
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kw)
AttentionInterface.register("record14", recording)
model.set_attn_implementation("record14")
out = []
for sid, ids in fidelity_windows(tok, Haystack.load(a.haystack), a.prefix, a.continuation, a.samples):
    rec["layers"] = []
    with torch.inference_mode():
        model(input_ids=ids, use_cache=False)
    L = rec["layers"]
    out.append({"sid": sid, "ids": ids[0], "q": torch.stack([x[0] for x in L]), "k": torch.stack([x[1] for x in L]),
                "v": torch.stack([x[2] for x in L])})
    print(sid, out[-1]["q"].shape, out[-1]["k"].shape, flush=True)
torch.save({"windows": out, "scale": rec["scale"], "prefix": a.prefix,
            "vocab": [tok.decode([i]) for i in range(len(tok))]}, a.out)
