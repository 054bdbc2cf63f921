"""Capture the fitted merger's refit inputs (state, parent, merged) on every real 8k layer for PRESET@BUDGET, once,
into /tmp/h14b/caps-PRESET-BUDGET.pt (issue 14, session 16), plus the merger's parameters.
    python results/issue14-cost/s16/caps.py STATES.pt PRESET@BUDGET ..."""
import sys, os, torch
from dataclasses import asdict
sys.path.insert(0, ".")
from kvcompress.pipeline import Pipeline
from kvcompress.presets import get_preset
from kvcompress.strategies import fitted as FD
torch.set_num_threads(1)
states = torch.load(sys.argv[1], weights_only=False)["states"]
orig = FD.FittedMerger.fit_plan
for spec in sys.argv[2:]:
    preset, budget = spec.split("@")
    path = f"/tmp/h14b/caps-{preset}-{budget}.pt"
    if os.path.exists(path):
        continue
    caps = []
    FD.FittedMerger.fit_plan = lambda self, st, p, m, **kw: caps.append((st, p, m)) or m
    pipe = Pipeline(get_preset(preset, keep_ratio=float(budget))); pipe.prepare(states)
    for l, st in enumerate(states): pipe.compress(st, layer_idx=l)
    FD.FittedMerger.fit_plan = orig
    torch.save({"merger": asdict(pipe.merger), "caps": caps}, path)
    print(spec, len(caps), flush=True)
