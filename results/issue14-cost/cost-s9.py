"""Fitting cost of every fitted preset against an 8k prefill, SmolLM2-135M, one thread, one process (issue 14,
session 9; target <= 2%).

    python results/issue14-cost/cost-s9.py --states results/tmp/s9/states-8k.pt --repeats 3 \
        --variants "preset;refine_share=1.0" --out results/issue14-cost/cost-8k-s9.json
Times (1) the model's 8k prefill (stock SDPA, no cache), (2) per fitted preset and budget, the pipeline's
compression of all 30 layers with the fitted preset and with its mean-merger twin (the same clusters), on
the real states of one 8k prefill (profile-s9/capture.py: through CompressedCache, so kvzip-csm's
reconstruction statistic and every layer's last 64 queries are there). The fitting cost is the difference
(fitted - twin) of the medians; repeats interleaved; load average recorded. --variants: ';'-separated merger
overrides of the fitted presets ("preset" = as registered), e.g. "refine_share=1.0" = session 8's setting.
"""
import argparse, json, os, platform, statistics, sys, time
sys.path.insert(0, ".")
import torch
from kvcompress.hf.loading import load_model
from kvcompress.pipeline import Pipeline
from kvcompress.presets import get_preset
from kvcompress.config import StrategySpec

PAIRS = {"centroidkv-fitted": ("centroidkv", {}), "semanticache-fitted": ("semanticache-fixed64", {}),
         "kvzip-csm-fitted": ("kvzip-csm", {}), "centroidkv-safe-fitted": ("centroidkv-safe", {"query_window": 64})}
p = argparse.ArgumentParser()
p.add_argument("--states", required=True)
p.add_argument("--presets", default=",".join(PAIRS))
p.add_argument("--budgets", default="0.5,0.25")
p.add_argument("--repeats", type=int, default=3)
p.add_argument("--variants", default="preset")
p.add_argument("--out", required=True)
a = p.parse_args()
torch.set_num_threads(1)
data = torch.load(a.states, weights_only=False)
states, ids = data["states"], data["ids"]
model, tok = load_model()

def prefill() -> float:
    model.set_attn_implementation("sdpa")
    t = time.perf_counter()
    with torch.inference_mode():
        model(input_ids=ids, use_cache=False, logits_to_keep=1)
    return time.perf_counter() - t

def parse(v: str) -> dict:
    out = {}
    for kv in filter(None, v.split(",")):
        k, x = kv.split("=")
        out[k] = x == "True" if x in ("True", "False") else (int(x) if x.lstrip("-").isdigit() else float(x))
    return out

variants = [v.strip() for v in a.variants.split(";") if v.strip()]
def configs(preset: str, budget: float):
    twin, over = PAIRS[preset]
    yield "twin", get_preset(twin, keep_ratio=budget).replace(**over)
    for v in variants:
        cfg = get_preset(preset, keep_ratio=budget)
        if v != "preset":
            cfg = cfg.replace(merger=StrategySpec("fitted", {**dict(cfg.merger.params), **parse(v)}))
        yield v, cfg

def run(cfg) -> float:
    pipe = Pipeline(cfg)
    pipe.prepare(states)  # cross-layer guards (kvzip-csm's), outside the timing: the same in both
    t = time.perf_counter()
    for l, st in enumerate(states):
        pipe.compress(st, layer_idx=l)
    return time.perf_counter() - t

prefill()
load = [os.getloadavg()]
times = {"prefill": []}
for rep in range(a.repeats):
    times["prefill"].append(prefill())
    for preset in a.presets.split(","):
        for budget in map(float, a.budgets.split(",")):
            for label, cfg in configs(preset, budget):
                times.setdefault(f"{preset}@{budget}:{label}", []).append(run(cfg))
    load.append(os.getloadavg())
    print(rep, {k: round(v[-1], 2) for k, v in times.items()}, flush=True)
med = {k: statistics.median(v) for k, v in times.items()}
summary = {}
for key in med:
    base, _, label = key.partition(":")
    if label and label != "twin":
        fit_s = med[key] - med[base + ":twin"]
        summary[key] = {"twin_s": med[base + ":twin"], "fitted_s": med[key], "fitting_s": fit_s,
                        "fitting_share_of_prefill": fit_s / med["prefill"]}
out = {"tokens": int(ids.shape[1]), "threads": 1, "repeats": a.repeats, "variants": variants, "pairs": PAIRS,
       "times": times, "prefill_s_median": med["prefill"], "summary": summary, "loadavg": load,
       "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
       "command": " ".join(sys.argv)}
json.dump(out, open(a.out, "w"), indent=1)
for k, v in summary.items():
    print(f"{k}: {100 * v['fitting_share_of_prefill']:.2f}% ({v['fitting_s']:.2f} s of {med['prefill']:.1f} s)")
