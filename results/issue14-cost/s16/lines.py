"""Self CPU time of refit per source LINE of fitting.py / fitted.py (torch.profiler stacks) on cached real 8k inputs
(caps.py) (issue 14, session 16).   python results/issue14-cost/s16/lines.py PRESET@BUDGET [ROWS]"""
import sys, collections, torch
sys.path.insert(0, ".")
from kvcompress.strategies import fitted as FD
torch.set_num_threads(1)
preset, budget = sys.argv[1].split("@")
d = torch.load(f"/tmp/h14b/caps-{preset}-{budget}.pt", weights_only=False)
caps, m = d["caps"], FD.FittedMerger(**d["merger"])
for c in caps: m.refit(*c)
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_stack=True,
        experimental_config=torch._C._profiler._ExperimentalConfig(verbose=True)) as prof:
    for c in caps: m.refit(*c)
acc = collections.defaultdict(float)
for ev in prof.events():
    if ev.device_type != torch.autograd.DeviceType.CPU or not ev.name.startswith("aten::") or ev.cpu_parent is not None and ev.cpu_parent.name.startswith("aten::") and False:
        continue
    line = next((f for f in (ev.stack or []) if "strategies/fitt" in f), None)
    if line is None:  # walk the python parents: their names are "file(line): func"
        par = ev.cpu_parent
        while par is not None and "strategies/fitt" not in par.name:
            par = par.cpu_parent
        line = par.name if par is not None else "?" 
    acc[(line, ev.name)] += ev.self_cpu_time_total / 1e3 / len(caps)
tot = sum(acc.values())
print(f"{sys.argv[1]}: {tot:.1f} ms/layer (self time of aten ops, profiled)")
for k, v in sorted(acc.items(), key=lambda x: -x[1])[: int(sys.argv[2]) if len(sys.argv) > 2 else 60]:
    print(f"{v:7.2f} {k[0]} {k[1]}")
