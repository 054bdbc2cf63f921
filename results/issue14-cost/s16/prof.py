"""Sections (thread CPU ms/layer) and a torch.profiler op table of the fitted merger's refit on cached real 8k
inputs (caps.py), with the shapes (issue 14, session 16).
    python results/issue14-cost/s16/prof.py PRESET@BUDGET [ROWS] [REPS]"""
import sys, time, os, torch
sys.path.insert(0, ".")
from kvcompress.strategies import fitted as FD
torch.set_num_threads(1)
preset, budget = sys.argv[1].split("@")
d = torch.load(f"/tmp/h14b/caps-{preset}-{budget}.pt", weights_only=False)
caps, m = d["caps"], FD.FittedMerger(**d["merger"])
print(m)
T = time.thread_time
acc = {}
def wrap(name):
    f = getattr(FD, name)
    def g(*a, **k):
        t = T(); out = f(*a, **k); acc[name] = acc.get(name, 0.0) + T() - t; return out
    setattr(FD, name, g)
    return f
origs = {n: wrap(n) for n in ("fit_clusters", "row_part", "split_moving", "refine_jointly", "grouped_queries", "_differs_from")}
shapes = []
fc = origs["fit_clusters"]
def rec(*a, **k):
    out = fc(*a, **k); shapes.append(tuple(out.keys.shape) + (a[4].shape[2],)); return out
FD.fit_clusters = lambda *a, **k: (lambda t0: (lambda out: (acc.__setitem__("fit_clusters", acc.get("fit_clusters", 0) + T() - t0), out)[1])(rec(*a, **k)))(T())
for c in caps: m.refit(*c)
print("K per layer (B,H,K,D,P):", sorted(s[2] for s in shapes)[len(shapes)//2], "median;", shapes[:3])
acc.clear(); tot = 0.0; reps = int(sys.argv[3]) if len(sys.argv) > 3 else 2
for r in range(reps):
    t = T()
    for c in caps: m.refit(*c)
    tot += T() - t
n = reps * len(caps)
print(f"{sys.argv[1]}: refit {tot / n * 1000:.1f} ms/layer; " + ", ".join(f"{k} {v / n * 1000:.1f}" for k, v in acc.items())
      + f"; load {os.getloadavg()}", flush=True)
for k, f in origs.items(): setattr(FD, k, f)
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
    for c in caps: m.refit(*c)
rows = int(sys.argv[2]) if len(sys.argv) > 2 else 40
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))
print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=rows))
