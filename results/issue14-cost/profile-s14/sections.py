"""Thread CPU time of the fit's sections (fit_clusters, row_part, split_moving, refine_jointly, the rest of refit)
on real 8k layers, per preset (issue 14, session 14).
    python results/issue14-cost/profile-s14/sections.py STATES.pt REPEATS PRESET@BUDGET ..."""
import sys, time, os, statistics, torch
sys.path.insert(0, ".")
from kvcompress.pipeline import Pipeline
from kvcompress.presets import get_preset
from kvcompress.strategies import fitted as FD
torch.set_num_threads(1)
states = torch.load(sys.argv[1], weights_only=False)["states"]
reps = int(sys.argv[2])
orig = FD.FittedMerger.fit_plan
T = time.thread_time
acc = {}
def wrap(name):
    f = getattr(FD, name)
    def g(*a, **k):
        t = T(); out = f(*a, **k); acc[name] = acc.get(name, 0.0) + T() - t; return out
    setattr(FD, name, g)
for n in ("fit_clusters", "row_part", "split_moving", "refine_jointly", "grouped_queries", "_differs_from"):
    wrap(n)
for spec in sys.argv[3:]:
    preset, budget = spec.split("@")
    caps = []
    FD.FittedMerger.fit_plan = lambda self, st, p, m: caps.append((st, p, m)) or m
    pipe = Pipeline(get_preset(preset, keep_ratio=float(budget))); pipe.prepare(states)
    for l, st in enumerate(states): pipe.compress(st, layer_idx=l)
    FD.FittedMerger.fit_plan = orig
    m = pipe.merger
    K = []
    for c in caps: m.refit(*c)
    acc.clear(); tot = 0.0
    for r in range(reps):
        t = T()
        for c in caps: m.refit(*c)
        tot += T() - t
    n = reps * len(caps)
    print(f"{spec}: refit {tot / n * 1000:.1f} ms/layer; " + ", ".join(f"{k} {v / n * 1000:.1f}" for k, v in acc.items())
          + f"; load {os.getloadavg()}", flush=True)
