"""Thread-CPU ms per layer of the fitted merger's refit and its sections on cached real 8k layers (s16/caps.py), with
merger overrides (issue 14, session 18; not interleaved: for shares of one run, not for A/B).
    python results/issue14-cost/s18/sections.py PRESET@BUDGET [k=v,k=v]"""
import sys, time, torch
sys.path.insert(0, ".")
from kvcompress.strategies import fitted as FD
torch.set_num_threads(1)
preset, budget = sys.argv[1].split("@")
over = dict(kv.split("=") for kv in sys.argv[2].split(",")) if len(sys.argv) > 2 and sys.argv[2] else {}
over = {k: float(v) if "." in v else int(v) for k, v in over.items()}
d = torch.load(f"/tmp/h14b/caps-{preset}-{budget}.pt", weights_only=False)
caps, m = d["caps"], FD.FittedMerger(**{**d["merger"], **over})
T = time.thread_time
acc = {}
def wrap(name):
    f = getattr(FD, name)
    def g(*a, **k):
        t = T(); out = f(*a, **k); acc[name] = acc.get(name, 0.0) + T() - t; return out
    setattr(FD, name, g)
for n in ("fit_clusters", "row_part", "split_moving", "refine_jointly", "_differs_from", "_compaction", "_gather_plan", "_compact", "cluster_index", "grouped_queries"):
    wrap(n)
fresh = lambda mm: mm.replace(keys=mm.keys.clone(), values=mm.values.clone(), log_sizes=mm.log_sizes.clone())
for c in caps[:3]: m.refit(c[0], c[1], fresh(c[2]), owned=True)
acc.clear(); tot = 0.0; reps = 3
for r in range(reps):
    for c in caps:
        mm = fresh(c[2]); t = T(); m.refit(c[0], c[1], mm, owned=True); tot += T() - t
n = reps * len(caps)
print(f"{sys.argv[1:]}: refit {tot / n * 1000:.1f} ms/layer; " + ", ".join(f"{k} {v / n * 1000:.2f}" for k, v in acc.items()), "other", round((tot - sum(acc.values()))/n*1000, 2))
