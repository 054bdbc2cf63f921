"""Thread CPU time of refit's sections on real 8k layers (issue 14, session 10; session 11: minor page faults per section too): each fitting function wrapped
with a timer, the rest of refit as "other".  python results/issue14-cost/profile-s10/sections.py STATES.pt PRESET BUDGET [k=v,...]"""
import sys, time, os, collections, resource, torch
sys.path.insert(0, ".")
from dataclasses import replace
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
kw = {}
for kv in filter(None, (sys.argv[4] if len(sys.argv) > 4 else "").split(",")):
    k, v = kv.split("="); kw[k] = int(v) if v.isdigit() else float(v)
m = replace(pipe.merger, **kw)
acc = collections.Counter(); flt = collections.Counter()
def timed(name, f):
    def g(*a, **k):
        f0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt; t = time.thread_time(); r = f(*a, **k); acc[name] += time.thread_time() - t; flt[name] += resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f0; return r
    return g
for n in ("fit_clusters", "row_part", "split_moving", "refine_jointly", "_differs_from", "grouped_queries", "_compaction", "cluster_index"):
    setattr(FD, n, timed(n, getattr(FD, n)))
for c in caps[:2]: m.refit(*c)
acc.clear(); flt.clear(); F0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
t = time.thread_time()
for rep in range(3):
    for c in caps: m.refit(*c)
total = (time.thread_time() - t) / 3 / len(caps) * 1000
print(sys.argv[2:], f"refit {total:.1f} ms/layer:", {k: round(v / 3 / len(caps) * 1000, 1) for k, v in acc.most_common()},
      "other", round(total - sum(acc.values()) / 3 / len(caps) * 1000, 1), "load", os.getloadavg())
print("minor faults/layer:", {k: round(v / 3 / len(caps)) for k, v in flt.most_common()}, "all",
      round((resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - F0) / 3 / len(caps)))
