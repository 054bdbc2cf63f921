"""Self CPU time of the fitted merger's refit per source line of fitting.py / fitted.py (torch.profiler with
stacks), real 8k layers (issue 14, session 15).
    python results/issue14-cost/floor-s15/prof_lines.py STATES.pt PRESET@BUDGET [ROWS]"""
import sys, collections, torch
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
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_stack=True) as prof:
    for c in caps: m.refit(*c)
acc = collections.defaultdict(float)
for ev in prof.events():
    if ev.device_type != torch.autograd.DeviceType.CPU or not ev.name.startswith("aten::"):
        continue
    par = ev.cpu_parent
    while par is not None and not ("strategies/fitt" in par.name and ".py(" in par.name):
        par = par.cpu_parent
    line = par.name if par is not None else "?"
    acc[line] += ev.self_cpu_time_total / 1e3 / len(caps)
tot = sum(acc.values())
print(f"{sys.argv[2]}: {tot:.1f} ms/layer (self time of aten ops, profiled)")
for k, v in sorted(acc.items(), key=lambda x: -x[1])[: int(sys.argv[3]) if len(sys.argv) > 3 else 40]:
    print(f"{v:7.2f} {k}")
