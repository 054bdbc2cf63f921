"""Real SmolLM2 8k states of 6 layers (0, 5, 12, 18, 24, 29) with the composed plans fit_plan receives,
for profiling the fit (issue 14, session 8): python results/issue14-cost/profile-s8/capture.py (writes real-*.pt
there, ~70 MB each: not committed)."""
import sys, torch
sys.path.insert(0, ".")
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from kvcompress.hf.loading import load_model
from kvcompress.eval.data import Haystack
from kvcompress.types import KVState
from kvcompress.pipeline import Pipeline
from kvcompress.presets import get_preset
from kvcompress.config import StrategySpec
from kvcompress.strategies import fitted as F
torch.set_num_threads(1)
model, tok = load_model()
text = Haystack.load("/work/shared/data/paul_graham_essays").window(tok, 8192 + 64)
ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"][:8192]])
vocab = [tok.decode([i]) for i in range(len(tok))]
rec = []
def recording(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kw):
    rec.append((query[0][:, -32:].clone(), key[0].clone(), value[0].clone()))
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kw)
AttentionInterface.register("rec", recording)
model.set_attn_implementation("rec")
with torch.inference_mode():
    model(input_ids=ids, use_cache=False, logits_to_keep=1)
layers = [0, 5, 12, 18, 24, 29]
states = [KVState.from_raw(rec[l][1][None], rec[l][2][None], token_ids=ids, vocab=vocab).replace(extras={"queries": rec[l][0][None]}) for l in layers]
orig = F.FittedMerger.fit_plan
for preset, budget in (("centroidkv", 0.25), ("centroidkv", 0.5), ("semanticache-fixed64", 0.25), ("centroidkv-safe", 0.25)):
    caps = []
    def grab(self, state, parent, merged):
        caps.append((state, parent, merged)); return orig(self, state, parent, merged)
    F.FittedMerger.fit_plan = grab
    cfg = get_preset(preset, keep_ratio=budget)
    pipe = Pipeline(cfg.replace(merger=StrategySpec("fitted", {"queries": "window", "reference_queries": 32, "refine": 0})))
    for l, st in zip(layers, states): pipe.compress(st, layer_idx=l)
    torch.save(caps, f"results/issue14-cost/profile-s8/real-{preset}-{budget}.pt"); print(preset, budget, len(caps), flush=True)
