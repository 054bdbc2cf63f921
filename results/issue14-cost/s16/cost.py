"""Fitting cost of every fitted preset against an 8k prefill, SmolLM2-135M, one thread, one process (issue 14,
session 16: results/issue14-cost/cost-s11.py with kvzip-copy-heads-banded added and fit_plan's ``owned`` passed
through (the pipeline passes it since session 16; the "old" variant, main's code, takes none); target: the fit <= 2%
of the prefill).

    nice -n 5 python results/issue14-cost/cost-s11.py --states results/tmp/s11/states-8k.pt --repeats 3 \
        --out results/issue14-cost/cost-s11.json
--variants "preset;old" --old DIR adds the variant "old": the same preset with FittedMerger.fit_plan dispatched to
DIR/fitted_old.py (an older fitted.py / fitting.py pair, see profile-s11/ab.py), interleaved with the new one.
Times, interleaved, repeats in one process (thread CPU time, the share read from it; wall time recorded too):
(1) the model's plain 8k prefill (stock SDPA, no cache, the same ids), (2) per fitted preset and budget, the
pipeline's compression of all 30 layers on the real states of one 8k prefill (profile-s9/capture.py, run with
kvzip-copy-heads-fitted: every statistic the presets read is there), with the fitted preset (the whole
compression: plan + fit) and with its twin (the same config, the merger the mean-merger preset of the same
clusters uses; for kvzip-copy-heads-fitted, whose clusterer is its own, the plain mean merger). The fit is
timed directly (FittedMerger.fit_plan inside the fitted run) and as the difference fitted - twin.
Cross-layer guards' prepare runs outside the timing (the same in both). Medians of the repeats; load recorded.
--variants: ';'-separated merger overrides of the fitted presets ("preset" = as registered)."""
import argparse, inspect, json, os, platform, resource, statistics, subprocess, sys, time
sys.path.insert(0, ".")
import torch
from kvcompress.hf.loading import load_model
from kvcompress.pipeline import Pipeline
from kvcompress.presets import get_preset
from kvcompress.config import StrategySpec
from kvcompress.strategies import fitted as FD

PAIRS = {"centroidkv-fitted": ("centroidkv", {}), "centroidkv-safe-fitted": ("centroidkv-safe", {"query_window": 64}),
         "semanticache-fitted": ("semanticache-fixed64", {}), "semanticache-safe-fitted": ("semanticache-safe", {}),
         "kvzip-csm-fitted": ("kvzip-csm", {}), "kvzip-copy-heads-fitted": (None, {}),
         "kvzip-copy-heads-banded": (None, {})}
p = argparse.ArgumentParser()
p.add_argument("--states", required=True)
p.add_argument("--presets", default=",".join(PAIRS))
p.add_argument("--budgets", default="0.5,0.25")
p.add_argument("--repeats", type=int, default=3)
p.add_argument("--variants", default="preset")
p.add_argument("--out", required=True)
p.add_argument("--old", default=None)
a = p.parse_args()
OLD = None
if a.old:
    sys.path.insert(0, a.old)
    import fitted_old as OLD
torch.set_num_threads(1)
data = torch.load(a.states, weights_only=False)
states, ids = data["states"], data["ids"]
model, tok = load_model()
model.set_attn_implementation("sdpa")

def prefill() -> tuple[float, float]:
    w, c = time.perf_counter(), time.thread_time()
    with torch.inference_mode():
        model(input_ids=ids, use_cache=False, logits_to_keep=1)
    return time.thread_time() - c, time.perf_counter() - w, 0.0, 0

def parse(v: str) -> dict:
    out = {}
    for kv in filter(None, v.split(",")):
        k, x = kv.split("=")
        out[k] = x == "True" if x in ("True", "False") else (int(x) if x.lstrip("-").isdigit() else float(x))
    return out

variants = [v.strip() for v in a.variants.split(";") if v.strip()]
def configs(preset: str, budget: float):
    twin, over = PAIRS[preset]
    fitted = get_preset(preset, keep_ratio=budget)
    yield "twin", (get_preset(twin, keep_ratio=budget).replace(**over) if twin else fitted.replace(merger=StrategySpec("mean")))
    for v in variants:
        cfg = fitted if v in ("preset", "old") else fitted.replace(merger=StrategySpec("fitted", {**dict(fitted.merger.params), **parse(v)}))
        yield v, cfg

fit_clock = [0.0]
fit_faults = [0]
use_old = [False]
orig = FD.FittedMerger.fit_plan
def timed_fit(self, state, parent, merged, **kw):
    f, c = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt, time.thread_time()
    if use_old[0]:
        from dataclasses import asdict
        # an old pair from session 16 on (main dce3317's, session 18) takes ``owned`` as the pipeline passes it
        takes = "owned" in inspect.signature(OLD.FittedMerger.fit_plan).parameters
        out = OLD.FittedMerger(**asdict(self)).fit_plan(state, parent, merged, **(kw if takes else {}))
    else:
        out = orig(self, state, parent, merged, **kw)
    fit_clock[0] += time.thread_time() - c
    fit_faults[0] += resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f
    return out
FD.FittedMerger.fit_plan = timed_fit

def run(cfg, old: bool = False) -> tuple[float, float, float, int]:
    use_old[0] = old
    pipe = Pipeline(cfg)
    pipe.prepare(states)  # cross-layer guards (kvzip-csm's, kvzip-copy-heads'), outside the timing: the same in both
    fit_clock[0] = 0.0
    fit_faults[0] = 0
    w, c = time.perf_counter(), time.thread_time()
    for l, st in enumerate(states):
        pipe.compress(st, layer_idx=l)
    return time.thread_time() - c, time.perf_counter() - w, fit_clock[0], fit_faults[0]

prefill()
load = [os.getloadavg()]
times = {"prefill": []}
for rep in range(a.repeats):
    times["prefill"].append(prefill())
    for preset in a.presets.split(","):
        for budget in map(float, a.budgets.split(",")):
            for label, cfg in configs(preset, budget):
                times.setdefault(f"{preset}@{budget}:{label}", []).append(run(cfg, label == "old"))
    load.append(os.getloadavg())
    print(rep, {k: round(v[-1][0], 2) for k, v in times.items()}, os.getloadavg(), flush=True)
med = {k: [statistics.median(x[i] for x in v) for i in range(len(v[0]))] for k, v in times.items()}
pre_cpu, pre_wall = med["prefill"][:2]
summary = {}
for key in med:
    base, _, label = key.partition(":")
    if label and label != "twin":
        cpu, wall, fit, faults = med[key]
        twin_cpu = med[base + ":twin"][0]
        summary[key] = {"fit_cpu_s": fit, "fit_share_of_prefill": fit / pre_cpu, "fit_minor_faults": faults,
                        "fitted_minus_twin_cpu_s": cpu - twin_cpu, "fitted_minus_twin_share": (cpu - twin_cpu) / pre_cpu,
                        "compression_cpu_s": cpu, "compression_share_of_prefill": cpu / pre_cpu,
                        "twin_cpu_s": twin_cpu, "twin_share_of_prefill": twin_cpu / pre_cpu,
                        "compression_wall_s": wall, "compression_wall_share": wall / pre_wall}
out = {"what": "issue 14 fitting cost vs the plain 8k prefill; thread CPU seconds (shares from CPU time), wall recorded",
       "tokens": int(ids.shape[1]), "threads": 1, "repeats": a.repeats, "variants": variants,
       "pairs": {k: v[0] or f"{k} with merger=mean" for k, v in PAIRS.items()},
       "times_cpu_wall_fit_faults": times, "prefill_cpu_s_median": pre_cpu, "prefill_wall_s_median": pre_wall,
       "summary": summary, "loadavg": load,
       "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                   "note": "2 cores shared with another helper and the lead's eval grid (see loadavg)"},
       "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
       "dirty": bool(subprocess.run(["git", "status", "--porcelain", "kvcompress"], capture_output=True, text=True).stdout.strip()),
       "command": "nice -n 5 python " + " ".join(sys.argv)}
json.dump(out, open(a.out, "w"), indent=1)
for k, v in summary.items():
    print(f"{k}: fit {100 * v['fit_share_of_prefill']:.2f}% (fitted-twin {100 * v['fitted_minus_twin_share']:.2f}%), "
          f"whole compression {100 * v['compression_share_of_prefill']:.2f}% (twin {100 * v['twin_share_of_prefill']:.2f}%) "
          f"of the {pre_cpu:.1f} s CPU prefill")
