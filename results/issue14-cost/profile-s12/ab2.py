"""The working tree's fitted merger against an older copy, interleaved layer by layer (issue 14, session 12;
profile-s11/ab.py interleaved whole pipeline runs, which a shared 2-core machine made noisy to +-10%): the fit's
inputs captured once per preset from a pipeline run, then per repeat every layer refitted by new and old in
alternating order, thread CPU time summed per repeat; the median of the per-repeat ratios new / old and the
largest relative difference of the outputs (0 = bit-identical).
    python results/issue14-cost/profile-s12/ab2.py STATES.pt OLD_DIR REPEATS PRESET@BUDGET ...
OLD_DIR as for profile-s11/ab.py (fitted_old.py / fitting_old.py)."""
import sys, time, os, statistics, torch
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
T = time.thread_time
for spec in sys.argv[4:]:
    preset, budget = spec.split("@")
    caps = []
    FD.FittedMerger.fit_plan = lambda self, st, p, m: caps.append((st, p, m)) or m
    pipe = Pipeline(get_preset(preset, keep_ratio=float(budget))); pipe.prepare(states)
    for l, st in enumerate(states): pipe.compress(st, layer_idx=l)
    FD.FittedMerger.fit_plan = orig
    new = pipe.merger
    old = OLD.FittedMerger(**asdict(new))
    worst = {"keys": 0.0, "values": 0.0, "log_sizes": 0.0}
    for c in caps:
        a, b = new.refit(*c), old.refit(*c)
        for n in worst:
            x, y = getattr(a, n), getattr(b, n)
            assert x.dtype == y.dtype and x.shape == y.shape and bool((torch.isfinite(x) == torch.isfinite(y)).all()), n
            if not torch.equal(x, y):
                x, y = x.double(), y.double(); fin = torch.isfinite(y)
                worst[n] = max(worst[n], float((x - y).abs()[fin].max() / y.abs()[fin].max().clamp(min=1e-30)))
    ratios, tn, to = [], [], []
    for r in range(reps):
        sn = so = 0.0
        for i, c in enumerate(caps):
            for m in ((new, old) if (r + i) % 2 == 0 else (old, new)):
                t = T(); m.refit(*c); d = T() - t
                if m is new: sn += d
                else: so += d
        ratios.append(sn / so); tn.append(sn / len(caps) * 1000); to.append(so / len(caps) * 1000)
    print(f"{spec}: ms/layer new {statistics.median(tn):.1f} old {statistics.median(to):.1f}; ratio median "
          f"{statistics.median(ratios):.3f} (range {min(ratios):.3f}-{max(ratios):.3f}); largest relative difference "
          f"{ {k: f'{v:.1e}' for k, v in worst.items()} }; load {os.getloadavg()}", flush=True)
