"""Real SmolLM2 8k layer states as the pipeline receives them after the prefill (issue 14, session 9):
one prefill through CompressedCache with kvzip-copy-heads-fitted (session 10; session 9 used kvzip-csm-fitted:
the reconstruction pass and the surprisal pass run, so the states carry both statistics), the last 64 queries
of every layer recorded; Pipeline.prepare's input is saved.
    python results/issue14-cost/profile-s9/capture.py [OUT]   (default results/tmp/s9/states-8k.pt, ~400 MB)
Replayed by cost.py (--states) and profile_fit.py (profile.py would shadow the stdlib module): every preset's pipeline runs on the same 30 states."""
import sys, time, torch
sys.path.insert(0, ".")
from kvcompress.hf.loading import load_model
from kvcompress.hf.cache import CompressedCache
from kvcompress.eval.data import Haystack
from kvcompress.pipeline import Pipeline
from kvcompress.protocols import Needs
torch.set_num_threads(1)
out = sys.argv[1] if len(sys.argv) > 1 else "results/tmp/s9/states-8k.pt"
model, tok = load_model()
text = Haystack.load("/work/shared/data/paul_graham_essays").window(tok, 8192 + 64)
ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"][:8192]])
got = []
orig = Pipeline.prepare
def grab(self, states):
    got.extend(states)
    return orig(self, states)
Pipeline.prepare = grab
cache = CompressedCache.for_model(model, tok, pipeline="kvzip-copy-heads-fitted", record=Needs(query_window=64))
t = time.perf_counter()
with torch.inference_mode():
    model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
print("prefill+pass+compress s", round(time.perf_counter() - t, 1), "states", len(got), flush=True)
cache.close()
def plain(s):  # contiguous copies (the cache's views would pin its whole buffers)
    return s.replace(keys=s.keys.contiguous().clone(), values=s.values.contiguous().clone(),
                     extras={k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in s.extras.items()})
torch.save({"ids": ids, "states": [plain(s) for s in got]}, out)
print("saved", out, {k: tuple(v.shape) for k, v in got[0].extras.items() if isinstance(v, torch.Tensor)},
      list(got[0].stats), tuple(got[0].keys.shape), got[0].keys.dtype)
