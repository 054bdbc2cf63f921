"""Per-op thread CPU time of FittedMerger.refit on real 8k layers, torch.profiler (issue 14, session 12): the fit's
inputs captured from a pipeline run, refit timed without tracing (total), then once under the profiler (ops).
    python results/issue14-cost/profile-s12/ops.py STATES.pt PRESET BUDGET [TOP]"""
import sys, time, os, torch
sys.path.insert(0, ".")
from kvcompress.pipeline import Pipeline
from kvcompress.presets import get_preset
from kvcompress.strategies import fitted as FD
torch.set_num_threads(1)
states = torch.load(sys.argv[1], weights_only=False)["states"]
caps = []
orig = FD.FittedMerger.fit_plan
FD.FittedMerger.fit_plan = lambda self, st, p, m: caps.append((st, p, m)) or m
pipe = Pipeline(get_preset(sys.argv[2], keep_ratio=float(sys.argv[3]))); pipe.prepare(states)
for l, st in enumerate(states): pipe.compress(st, layer_idx=l)
FD.FittedMerger.fit_plan = orig
m = pipe.merger
for c in caps: m.refit(*c)
ts = []
for r in range(3):
    t = time.thread_time()
    for c in caps: m.refit(*c)
    ts.append((time.thread_time() - t) / len(caps) * 1000)
print(sys.argv[2:4], "refit ms/layer", [round(x, 1) for x in ts], "load", os.getloadavg())
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
    for c in caps: m.refit(*c)
print(prof.key_averages(group_by_input_shape=len(sys.argv) > 5).table(sort_by="self_cpu_time_total", row_limit=int(sys.argv[4]) if len(sys.argv) > 4 else 30, max_name_column_width=40, max_shapes_column_width=60))
