"""Per-layer thread CPU time of a fitted preset's parts on real 8k layers (issue 14, session 10), interleaved:
the mean-merger twin's compression, the fitted pipeline's rounds alone (fit_plan skipped), and refit under
several merger settings.
    python results/issue14-cost/profile-s10/parts.py STATES.pt PRESET TWIN BUDGET REPEATS "k=v,..." ...
TWIN: the mean-merger preset with the same clusters ("centroidkv-safe:query_window=64" style overrides)."""
import sys, time, os, statistics, torch
sys.path.insert(0, ".")
from dataclasses import replace
from kvcompress.pipeline import Pipeline
from kvcompress.presets import get_preset
from kvcompress.strategies import fitted as FD
torch.set_num_threads(1)
states = torch.load(sys.argv[1], weights_only=False)["states"]
budget, reps = float(sys.argv[4]), int(sys.argv[5])
cfg = get_preset(sys.argv[2], keep_ratio=budget)
tname, _, tover = sys.argv[3].partition(":")
twin = get_preset(tname, keep_ratio=budget)
if tover:
    twin = twin.replace(**{k: int(v) for k, v in (kv.split("=") for kv in tover.split(","))})
caps = []
orig = FD.FittedMerger.fit_plan
def compress(c, grab=False):
    pipe = Pipeline(c); pipe.prepare(states)
    t = time.thread_time()
    for l, st in enumerate(states): pipe.compress(st, layer_idx=l)
    return (time.thread_time() - t) / len(states) * 1000, pipe
FD.FittedMerger.fit_plan = lambda self, st, p, m: caps.append((st, p, m)) or m
_, pipe = compress(cfg)
def parse(spec):
    out = {}
    for kv in filter(None, spec.split(",")):
        k, v = kv.split("="); out[k] = v == "True" if v in ("True", "False") else (int(v) if v.isdigit() else float(v))
    return replace(pipe.merger, **out)
ms = [parse(s) for s in sys.argv[6:]]
FD.FittedMerger.fit_plan = lambda self, st, p, m: m
labels = ["twin", "rounds"] + [s or "preset" for s in sys.argv[6:]]
ts = {k: [] for k in labels}
load0 = os.getloadavg()
for r in range(reps):
    ts["twin"].append(compress(twin)[0])
    ts["rounds"].append(compress(cfg)[0])
    for spec, m in zip(sys.argv[6:], ms):
        t = time.thread_time()
        for c in caps: m.refit(*c)
        ts[spec or "preset"].append((time.thread_time() - t) / len(caps) * 1000)
FD.FittedMerger.fit_plan = orig
print(f"{sys.argv[2]}@{budget} ms/layer (median of {reps}):",
      {k: round(statistics.median(v), 1) for k, v in ts.items()}, "load", load0, os.getloadavg(), flush=True)
