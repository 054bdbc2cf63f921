"""Thread CPU time of FittedMerger.refit under several settings, interleaved, on real 8k layers (issue 14, s9).
    python results/issue14-cost/profile-s9/timeab.py STATES.pt PRESET BUDGET REPEATS "k=v,..." "k=v,..." ...
("" = the preset's own merger). Prints ms per layer (median over repeats) and the sizes K / Nm / S / N."""
import sys, time, os, statistics, torch
sys.path.insert(0, ".")
from dataclasses import replace
from kvcompress.pipeline import Pipeline
from kvcompress.presets import get_preset
from kvcompress.strategies import fitted as FD
torch.set_num_threads(1)
states = torch.load(sys.argv[1], weights_only=False)["states"]
cfg = get_preset(sys.argv[2], keep_ratio=float(sys.argv[3]))
reps = int(sys.argv[4])
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
ms = [parse(s) for s in sys.argv[5:]]
for m in ms:
    for c in caps[:2]: m.refit(*c)
ts = [[] for _ in ms]
load0 = os.getloadavg()
for r in range(reps):
    for i, m in enumerate(ms):
        t = time.thread_time()
        for c in caps: m.refit(*c)
        ts[i].append((time.thread_time() - t) / len(caps) * 1000)
for spec, t in zip(sys.argv[5:], ts):
    print(f"{sys.argv[2]}@{sys.argv[3]} [{spec or 'preset'}]: {statistics.median(t):.1f} ms/layer (x{len(caps)} = "
          f"{statistics.median(t) * len(caps) / 1000:.2f} s) all {[round(x, 1) for x in t]}")
print("load", load0, os.getloadavg())
