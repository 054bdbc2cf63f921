"""Where FittedMerger.refit's time goes on real 8k SmolLM2 layers, op by op (issue 14, session 10).
    python results/issue14-cost/profile-s10/ops.py STATES.pt PRESET BUDGET [k=v,...]
STATES.pt from profile-s9/capture.py. Grabs what fit_plan receives on all 30 layers, then: refit's thread CPU
time (median of 3), the minor page faults per layer, and torch.profiler's op table (self CPU, 1 thread)."""
import sys, time, os, statistics, resource, torch
sys.path.insert(0, ".")
from dataclasses import replace
from kvcompress.pipeline import Pipeline
from kvcompress.presets import get_preset
from kvcompress.strategies import fitted as FD
torch.set_num_threads(1)
states = torch.load(sys.argv[1], weights_only=False)["states"]
cfg = get_preset(sys.argv[2], keep_ratio=float(sys.argv[3]))
caps = []
orig = FD.FittedMerger.fit_plan
FD.FittedMerger.fit_plan = lambda self, st, p, m: caps.append((st, p, m)) or m
pipe = Pipeline(cfg); pipe.prepare(states)
for l, st in enumerate(states): pipe.compress(st, layer_idx=l)
FD.FittedMerger.fit_plan = orig
over = {}
for kv in filter(None, (sys.argv[4] if len(sys.argv) > 4 else "").split(",")):
    k, v = kv.split("="); over[k] = v == "True" if v in ("True", "False") else (int(v) if v.isdigit() else float(v))
m = replace(pipe.merger, **over)
for c in caps[:3]: m.refit(*c)
ts = []
for _ in range(3):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt; t = time.thread_time()
    for c in caps: m.refit(*c)
    ts.append((time.thread_time() - t) / len(caps) * 1000)
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / len(caps)
print(sys.argv[2:], "refit ms/layer", [round(x, 1) for x in ts], "median", round(statistics.median(ts), 1),
      "minor faults/layer", round(faults), "load", os.getloadavg(), flush=True)
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU]) as prof:
    for c in caps: m.refit(*c)
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
if os.environ.get("SHAPES"):
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for c in caps: m.refit(*c)
    print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=20, max_shapes_column_width=80))
