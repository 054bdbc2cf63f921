"""Fitted slots of two FittedMerger settings on real 8k layers (issue 14, session 9): largest differences.
    python results/issue14-cost/profile-s9/ab.py STATES.pt PRESET BUDGET "a.k=v,..." "b.k=v,..." """
import sys, torch
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
def parse(spec):
    out = {}
    for kv in filter(None, spec.split(",")):
        k, v = kv.split("="); out[k] = v == "True" if v in ("True", "False") else (int(v) if v.isdigit() else float(v))
    return replace(pipe.merger, **out)
A, B = parse(sys.argv[4]), parse(sys.argv[5])
worst = {"keys": 0.0, "values": 0.0, "log_sizes": 0.0}
for c in caps:
    a, b = A.refit(*c), B.refit(*c)
    for n in worst:
        x, y = getattr(a, n).double(), getattr(b, n).double()
        fin = torch.isfinite(x) & torch.isfinite(y)
        assert bool((torch.isfinite(x) == torch.isfinite(y)).all()), n
        worst[n] = max(worst[n], float(((x - y).abs()[fin]).max() / (1e-6 + y.abs()[fin].max())))
print(sys.argv[2], sys.argv[3], sys.argv[4], "vs", sys.argv[5], "largest relative difference", worst)
