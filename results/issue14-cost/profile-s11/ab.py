"""The working tree's fitted merger against a copy of an older one, on real 8k SmolLM2 layers (issue 14, session 11):
largest differences of the fitted slots, thread CPU time of refit interleaved in one process, minor page faults.
    python results/issue14-cost/profile-s11/ab.py STATES.pt OLD_DIR REPEATS PRESET@BUDGET ...
OLD_DIR holds fitted_old.py / fitting_old.py: the old kvcompress/strategies/fitted.py and fitting.py with their
relative imports made absolute (fitting_old) and the @register_merger line dropped, e.g. from `git show REF:...`.
Relative difference: max |new - old| / max |old| over the layer, per tensor, worst layer (0 = bit-identical)."""
import sys, time, os, statistics, resource, torch
sys.path.insert(0, "."); sys.path.insert(0, sys.argv[2])
from dataclasses import asdict
from kvcompress.pipeline import Pipeline
from kvcompress.presets import get_preset
from kvcompress.strategies import fitted as FD
import fitted_old as OLD
torch.set_num_threads(1)
states = torch.load(sys.argv[1], weights_only=False)["states"]
reps = int(sys.argv[3])
orig = FD.FittedMerger.fit_plan
def faults():
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
for spec in sys.argv[4:]:
    preset, budget = spec.split("@")
    caps = []
    FD.FittedMerger.fit_plan = lambda self, st, p, m: caps.append((st, p, m)) or m
    pipe = Pipeline(get_preset(preset, keep_ratio=float(budget))); pipe.prepare(states)
    for l, st in enumerate(states): pipe.compress(st, layer_idx=l)
    FD.FittedMerger.fit_plan = orig
    new = pipe.merger
    old = OLD.FittedMerger(**asdict(new))
    worst = {"keys": 0.0, "values": 0.0, "log_sizes": 0.0, "counts": 0.0}
    for c in caps:
        a, b = new.refit(*c), old.refit(*c)
        for n in worst:
            x, y = getattr(a, n), getattr(b, n)
            assert x.dtype == y.dtype and x.shape == y.shape and bool((torch.isfinite(x) == torch.isfinite(y)).all()), n
            if torch.equal(x, y):
                continue
            x, y = x.double(), y.double()
            fin = torch.isfinite(y)
            worst[n] = max(worst[n], float((x - y).abs()[fin].max() / y.abs()[fin].max().clamp(min=1e-30)))
    ts = {"new": [], "old": []}
    fl = {"new": [], "old": []}
    # timed inside whole pipeline runs (the plan's allocations between the fits, as in cost-s10.py): the
    # pipeline's merger is the new one; its fit_plan dispatches to the merger under test
    use = {}
    def timed(self, st, p, m):
        f0, t = faults(), time.thread_time()
        out = (orig if use["m"] is new else OLD.FittedMerger.fit_plan)(use["m"], st, p, m)
        use["t"] += time.thread_time() - t; use["f"] += faults() - f0
        return out
    cfg = get_preset(preset, keep_ratio=float(budget))
    for r in range(reps):
        for label, m in (("new", new), ("old", old)) if r % 2 == 0 else (("old", old), ("new", new)):
            use.update(m=m, t=0.0, f=0)
            FD.FittedMerger.fit_plan = timed
            pipe = Pipeline(cfg); pipe.prepare(states)
            for l, st in enumerate(states): pipe.compress(st, layer_idx=l)
            FD.FittedMerger.fit_plan = orig
            ts[label].append(use["t"] / len(caps) * 1000)
            fl[label].append(use["f"] / len(caps))
    if not reps:
        print(f"{spec}: largest relative difference { {k: f'{v:.1e}' for k, v in worst.items()} }", flush=True)
        continue
    print(f"{spec}: refit ms/layer new {statistics.median(ts['new']):.1f} old {statistics.median(ts['old']):.1f} "
          f"(ratio {statistics.median(ts['new']) / statistics.median(ts['old']):.3f}); faults/layer new "
          f"{statistics.median(fl['new']):.0f} old {statistics.median(fl['old']):.0f}; largest relative difference "
          f"{ {k: f'{v:.1e}' for k, v in worst.items()} }; load {os.getloadavg()}", flush=True)
