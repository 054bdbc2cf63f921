"""A/B of refit: main (/work/main) against this tree on the same captures, interleaved, thread CPU time,
medians; also the largest relative difference of their outputs: python .../ab.py CAPTURE.pt REFINE [REPEATS]"""
import sys, time, torch, importlib, statistics
torch.set_num_threads(1)
caps = torch.load(sys.argv[1], weights_only=False)
refine = int(sys.argv[2]); reps = int(sys.argv[3]) if len(sys.argv) > 3 else 7
def load(root):
    for m in [m for m in sys.modules if m.startswith("kvcompress")]: del sys.modules[m]
    sys.path.insert(0, root); mod = importlib.import_module("kvcompress.strategies.fitted"); sys.path.pop(0)
    return mod.FittedMerger(queries="window", reference_queries=32, refine=refine)
A, B = load("/work/main"), load("/work/wt/h14")
outs = {}
for name, m in (("main", A), ("new", B)):
    outs[name] = [m.refit(*c) for c in caps]
err = max(float((a.values - b.values).abs().max() / (1 + a.values.abs().max())) for a, b in zip(outs["main"], outs["new"]))
errk = max(float((a.keys - b.keys).abs().max() / (1 + a.keys.abs().max())) for a, b in zip(outs["main"], outs["new"]))
print("max rel diff values", err, "keys", errk)
ts = {"main": [], "new": []}
for r in range(reps):
    for name, m in (("main", A), ("new", B)):
        t = time.thread_time()
        for c in caps: m.refit(*c)
        ts[name].append((time.thread_time() - t) / len(caps) * 1000)
print({k: round(statistics.median(v), 1) for k, v in ts.items()}, {k: [round(x) for x in v] for k, v in ts.items()})
