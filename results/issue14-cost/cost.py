"""Fitting cost against an 8k prefill, SmolLM2-135M, one process, interleaved (issue 14, target <= 2%).

    python results/issue14-cost/cost.py --tokens 8192 --R 64,32 --repeats 3 --out results/issue14-cost/cost.json
    (--refine 0,3: the fitted merger with each number of joint steps, 0 = the closed form only)
Times (1) the model's 8k prefill (stock SDPA, no cache compression), (2) per preset the pipeline's
compression of all 30 layers with the mean merger and with the fitted merger, on the real cache of
that prefill (the fitted merger as in the fitted presets: the layer's last R queries, which the
cache keeps anyway; --queries prefill: R strided prefill queries). The fitting cost is the
difference (2, fitted) - (2, mean). Repeats interleaved; medians reported; load average recorded.
--R takes several counts ("64,32"): the largest is recorded, each fit reads its own last R.
"""
import argparse, json, os, platform, statistics, sys, time
sys.path.insert(0, ".")
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from kvcompress.hf.loading import load_model
from kvcompress.eval.data import Haystack
from kvcompress.types import KVState
from kvcompress.pipeline import Pipeline
from kvcompress.presets import get_preset
from kvcompress.config import StrategySpec

p = argparse.ArgumentParser()
p.add_argument("--tokens", type=int, default=8192)
p.add_argument("--R", default="64", help="window queries per layer, several comma-separated")
p.add_argument("--repeats", type=int, default=2)
p.add_argument("--presets", default="centroidkv,semanticache-fixed64")
p.add_argument("--budgets", default="0.5,0.25")
p.add_argument("--threads", type=int, default=1)
p.add_argument("--queries", default="window", choices=["window", "prefill"])
p.add_argument("--refine", default=None, help="the fitted merger's refine steps, several comma-separated (default: its default)")
p.add_argument("--out", required=True)
a = p.parse_args()
Rs = [int(r) for r in str(a.R).split(",")]
R_MAX = max(Rs)
torch.set_num_threads(a.threads)
model, tok = load_model()
text = Haystack.load("/work/shared/data/paul_graham_essays").window(tok, a.tokens + 64)
ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"][: a.tokens]])
vocab = [tok.decode([i]) for i in range(len(tok))]
rec = []
def recording(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kw):
    idx = torch.linspace(0, query.shape[2] - 1, R_MAX).round().long()
    rec.append((query[0][:, idx].clone(), query[0][:, -R_MAX:].clone(), key[0].clone(), value[0].clone()))
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kw)
AttentionInterface.register("record14", recording)

def prefill(record: bool) -> float:
    model.set_attn_implementation("record14" if record else "sdpa")
    t = time.perf_counter()
    with torch.inference_mode():
        model(input_ids=ids, use_cache=False, logits_to_keep=1)
    return time.perf_counter() - t

prefill(True)
states = [KVState.from_raw(k[None], v[None], token_ids=ids, vocab=vocab).replace(
    extras={"reference_queries": q[None], "queries": w[None]}) for q, w, k, v in rec]
rec.clear()
load = [os.getloadavg()]
times = {"prefill": []}
for rep in range(a.repeats):
    times["prefill"].append(prefill(False))
    for preset in a.presets.split(","):
        for budget in map(float, a.budgets.split(",")):
            refines = [None] if a.refine is None else [int(x) for x in a.refine.split(",")]
            for merger in ("mean", *(f"fitted-R{r}" + ("" if f is None else f"-refine{f}") for r in Rs for f in refines)):
                cfg = get_preset(preset, keep_ratio=budget)
                if merger != "mean":
                    r = int(merger.split("-R")[1].split("-")[0])
                    params = {"queries": a.queries, "reference_queries": r}
                    if "-refine" in merger:
                        params["refine"] = int(merger.split("-refine")[1])
                    cfg = cfg.replace(merger=StrategySpec("fitted", params))
                pipe = Pipeline(cfg)
                t = time.perf_counter()
                for l, st in enumerate(states):
                    pipe.compress(st, layer_idx=l)
                times.setdefault(f"{preset}@{budget}:{merger}", []).append(time.perf_counter() - t)
    load.append(os.getloadavg())
    print(rep, {k: round(v[-1], 2) for k, v in times.items()}, flush=True)
med = {k: statistics.median(v) for k, v in times.items()}
summary = {}
for key in med:
    if ":fitted" in key:
        base, how = key.split(":")
        fit_s = med[key] - med[base + ":mean"]
        summary[f"{base}:{how}"] = {"mean_s": med[base + ":mean"], "fitted_s": med[key], "fitting_s": fit_s,
                                    "fitting_share_of_prefill": fit_s / med["prefill"]}
out = {"tokens": a.tokens, "R": Rs, "queries": a.queries, "threads": a.threads, "repeats": a.repeats, "times": times,
       "prefill_s_median": med["prefill"], "summary": summary, "loadavg": load,
       "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
       "command": " ".join(sys.argv)}
json.dump(out, open(a.out, "w"), indent=1)
print(json.dumps(summary, indent=1))
