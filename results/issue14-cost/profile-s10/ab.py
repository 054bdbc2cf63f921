"""The session-10 fit against session 9's (tests/slow_reference/fitting_v0.py) on real 8k SmolLM2 layers
(issue 14): the largest differences of the fitted slots, and both fits' thread CPU time, interleaved.
    python results/issue14-cost/profile-s10/ab.py STATES.pt REPEATS PRESET@BUDGET[:k=v,...] ...
Relative difference: max |new - old| / max |old| over the layer's fitted rows, per tensor, worst layer."""
import sys, time, os, statistics, torch
sys.path.insert(0, "."); sys.path.insert(0, "tests")
from dataclasses import replace
from kvcompress.pipeline import Pipeline
from kvcompress.presets import get_preset
from kvcompress.strategies import fitted as FD
from slow_reference import fitting_v0 as REF
torch.set_num_threads(1)
states = torch.load(sys.argv[1], weights_only=False)["states"]
reps = int(sys.argv[2])
orig = FD.FittedMerger.fit_plan
for spec in sys.argv[3:]:
    name, _, over = spec.partition(":")
    preset, budget = name.split("@")
    caps = []
    FD.FittedMerger.fit_plan = lambda self, st, p, m: caps.append((st, p, m)) or m
    pipe = Pipeline(get_preset(preset, keep_ratio=float(budget))); pipe.prepare(states)
    for l, st in enumerate(states): pipe.compress(st, layer_idx=l)
    FD.FittedMerger.fit_plan = orig
    kw = {}
    for kv in filter(None, over.split(",")):
        k, v = kv.split("="); kw[k] = int(v) if v.isdigit() else float(v)
    m = replace(pipe.merger, **kw)
    worst = {"keys": 0.0, "values": 0.0, "log_sizes": 0.0}
    for c in caps:
        a, b = m.refit(*c), REF.refit(m, *c)
        for n in worst:
            x, y = getattr(a, n).double(), getattr(b, n).double()
            assert bool((torch.isfinite(x) == torch.isfinite(y)).all()), n
            fin = torch.isfinite(y)
            worst[n] = max(worst[n], float((x - y).abs()[fin].max() / y.abs()[fin].max().clamp(min=1e-30)))
    ts = {"new": [], "old": []}
    for r in range(reps):
        for label, f in (("new", m.refit), ("old", lambda *c: REF.refit(m, *c))):
            t = time.thread_time()
            for c in caps: f(*c)
            ts[label].append((time.thread_time() - t) / len(caps) * 1000)
    print(f"{spec}: ms/layer new {statistics.median(ts['new']):.1f} old {statistics.median(ts['old']):.1f}; "
          f"largest relative difference {({k: f'{v:.1e}' for k, v in worst.items()})}; load {os.getloadavg()}", flush=True)
