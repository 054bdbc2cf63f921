"""Where the live KL of the fitted merger comes from (issue 14, item "close the gap"): one model
prefill per variant through the live cache, KL(full || compressed) over the teacher-forced
continuation (the `kvcompress eval fidelity` windows: prefix 1000, continuation 500), with a
*different* pipeline on a group of layers than on the rest.

    python results/issue14-gap/layers.py --budget 0.25 --out results/issue14-gap/layers-pg-s0-0.25.jsonl \
        --variants 'base=centroidkv;alt=centroidkv-fitted;groups=6' ...

A variant "name=BASE|ALT|LAYERS" runs BASE on every layer but LAYERS (comma list or a-b), ALT there.
Presets may carry overrides as in results/issue14-eval/run.py (preset@key=value;key=value).
"""
import argparse, json, os, sys, time
from pathlib import Path
sys.path.insert(0, ".")
import torch
from kvcompress.hf import CompressedCache
from kvcompress.hf.loading import load_model
from kvcompress.pipeline import Pipeline
from kvcompress.presets import get_preset
from kvcompress.eval.data import Haystack
from kvcompress.eval.fidelity import fidelity_windows, compare


def config(spec, budget):
    name, _, rest = spec.partition("@")
    over = {k: json.loads(v) for k, v in (kv.split("=", 1) for kv in rest.split(";") if kv)}
    return get_preset(name, keep_ratio=budget, **over)


class PerLayer(Pipeline):
    """BASE's pipeline, ALT's on ``layers`` (needs: the union of both)."""

    def __init__(self, base, alt, layers):
        super().__init__(base)
        self.alt = Pipeline(alt)
        self.alt_layers = frozenset(layers)
        self._needs_both = self.needs | self.alt.needs

    @property
    def needs(self):
        return getattr(self, "_needs_both", None) or super().needs

    def compress(self, state, layer_idx=None):
        if layer_idx in self.alt_layers:
            return self.alt.compress(state, layer_idx)
        return super().compress(state, layer_idx)


def layer_set(text):
    out = []
    for part in text.split(","):
        if "-" in part:
            a, b = part.split("-")
            out += range(int(a), int(b) + 1)
        elif part:
            out.append(int(part))
    return out


p = argparse.ArgumentParser()
p.add_argument("--haystack", default="/work/shared/data/paul_graham_essays")
p.add_argument("--sample", type=int, default=0)
p.add_argument("--budget", type=float, default=0.25)
p.add_argument("--variants", nargs="+", required=True, help="name=BASE|ALT|LAYERS or name=PRESET")
p.add_argument("--out", required=True)
a = p.parse_args()
torch.set_num_threads(1)
model, tok = load_model()
hay = Haystack.load(None if a.haystack == "pydoc" else a.haystack)
sid, ids = fidelity_windows(tok, hay, 1000, 500, samples=a.sample + 1)[a.sample]
done = set()
if Path(a.out).exists():
    done = {json.loads(l)["name"] for l in open(a.out) if l.strip()}


def run(pipe):
    cache = CompressedCache.for_model(model, tok, pipe, backend="sdpa")
    try:
        with torch.inference_mode():
            model.base_model(input_ids=ids[:, :1000], use_cache=True, past_key_values=cache)
            cache.enabled = False
            return model(input_ids=ids[:, 1000:-1], use_cache=True, past_key_values=cache).logits[0].float()
    finally:
        cache.close()


ref = None
for v in a.variants:
    name, _, spec = v.partition("=")
    if name in done:
        continue
    if ref is None:
        ref = run(None)
    parts = spec.split("|")
    pipe = (Pipeline(config(parts[0], a.budget)) if len(parts) == 1
            else PerLayer(config(parts[0], a.budget), config(parts[1], a.budget), layer_set(parts[2])))
    t = time.perf_counter()
    m = compare(ref, run(pipe), ids[0, 1001:])
    rec = {"name": name, "spec": spec, "sample_id": sid, "haystack": hay.name, "budget": a.budget,
           "kl": m["kl"], "top1": m["top1"], "ppl_delta": m["ppl_delta"], "seconds": round(time.perf_counter() - t, 2),
           "loadavg": os.getloadavg()[0], "time": time.strftime("%H:%M:%S")}
    with open(a.out, "a") as f:
        f.write(json.dumps(rec) + "\n")
    print(name, round(m["kl"], 5), rec["seconds"], flush=True)
