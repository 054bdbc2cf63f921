"""torch.profiler op table of the fitted merger's refit on real 8k layers (issue 14, session 15).
    python results/issue14-cost/floor-s15/prof.py STATES.pt PRESET@BUDGET [ROWS]"""
import sys, torch
sys.path.insert(0, ".")
from kvcompress.pipeline import Pipeline
from kvcompress.presets import get_preset
from kvcompress.strategies import fitted as FD
torch.set_num_threads(1)
states = torch.load(sys.argv[1], weights_only=False)["states"]
preset, budget = sys.argv[2].split("@")
caps = []
orig = FD.FittedMerger.fit_plan
FD.FittedMerger.fit_plan = lambda self, st, p, m: caps.append((st, p, m)) or m
pipe = Pipeline(get_preset(preset, keep_ratio=float(budget))); pipe.prepare(states)
for l, st in enumerate(states): pipe.compress(st, layer_idx=l)
FD.FittedMerger.fit_plan = orig
m = pipe.merger
for c in caps: m.refit(*c)
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
    for c in caps: m.refit(*c)
print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=int(sys.argv[3]) if len(sys.argv) > 3 else 30))
