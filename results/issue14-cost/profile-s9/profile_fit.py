"""Where the fit's time goes, per part, on real 8k SmolLM2 layers (issue 14, session 9).

    python results/issue14-cost/profile-s9/profile_fit.py STATES.pt PRESET BUDGET [merger.k=v ...]
STATES.pt from capture.py. Runs PRESET's pipeline at BUDGET on all 30 layers, grabbing what
fit_plan receives, then times FittedMerger.refit on those inputs (thread CPU time, 3 repeats, median)
and line by line (sys.settrace; the lines of refit and of the fitting functions, ms per layer)."""
import sys, time, statistics, collections, linecache, os
sys.path.insert(0, ".")
import torch
from dataclasses import replace
from kvcompress.pipeline import Pipeline
from kvcompress.presets import get_preset
from kvcompress.strategies import fitted as FD, fitting as FT
torch.set_num_threads(1)
path, preset, budget = sys.argv[1], sys.argv[2], float(sys.argv[3])
over = dict(kv.split("=", 1) for kv in sys.argv[4:])
states = torch.load(path, weights_only=False)["states"]
cfg = get_preset(preset, keep_ratio=budget)
caps = []
orig = FD.FittedMerger.fit_plan
def grab(self, state, parent, merged):
    caps.append((state, parent, merged)); return merged
FD.FittedMerger.fit_plan = grab
pipe = Pipeline(cfg)
pipe.prepare(states)
for l, st in enumerate(states):
    pipe.compress(st, layer_idx=l)
FD.FittedMerger.fit_plan = orig
m = pipe.merger
conv = {k: (type(getattr(m, k))(v) if getattr(m, k) is not None and not isinstance(getattr(m, k), bool)
            else (v == "True" if isinstance(getattr(m, k), bool) else float(v))) for k, v in over.items()}
m = replace(m, **conv)
print(preset, budget, m, "load", os.getloadavg(), flush=True)
K = [int(FD._compaction(torch.zeros(1))[2]) if False else 0 for _ in caps]
T = time.thread_time
for c in caps[:3]: m.refit(*c)
ts = []
for rep in range(3):
    t = T()
    for c in caps: m.refit(*c)
    ts.append((T() - t) / len(caps) * 1000)
print("refit ms/layer", [round(x, 1) for x in ts], "median", round(statistics.median(ts), 1), "x30 =",
      round(statistics.median(ts) * 30 / 1000, 2), "s", flush=True)
targets = {f.__code__ for f in (FT.fit_clusters, FT.split_moving, FT.refine_jointly, FD.FittedMerger.refit, FT._attention, FT.row_part, FT._weights)}
targets |= {getattr(FT, n).__code__ for n in dir(FT) if n.startswith("fast_") or n.startswith("_fast")}
targets |= {getattr(FD, n).__code__ for n in dir(FD) if n.startswith("_") and callable(getattr(FD, n)) and hasattr(getattr(FD, n), "__code__")}
acc = collections.Counter(); last = {}
def tracer(frame, event, arg):
    if frame.f_code not in targets: return None
    def local(frame, event, arg):
        now = T(); key = id(frame)
        if key in last:
            acc[last[key][1]] += now - last[key][0]
        if event == "return": last.pop(key, None); return local
        last[key] = (T(), (frame.f_code.co_filename, frame.f_lineno)); return local
    return local
sys.settrace(tracer)
for c in caps: m.refit(*c)
sys.settrace(None)
n = len(caps)
for (f, l), t in sorted(acc.items(), key=lambda x: -x[1])[:40]:
    print(f"{t/n*1000:7.2f} ms  {f.split('/')[-1]}:{l}  {linecache.getline(f, l).strip()[:110]}")
# the sizes: fitted slots K, their members and dropped slots Nm, slots that stay S (per head, layer mean)
sz = []
for st, parent, merged in caps:
    cl = FD.cluster_index(parent)
    member = cl >= 0
    differs = member & FD._differs_from(st.keys.contiguous(), parent.clamp(min=0))
    M = merged.log_sizes.shape[-1]
    fit = torch.zeros(st.keys.shape[0], st.keys.shape[1], M + 1).scatter_add_(-1, torch.where(member, cl, M), differs.float())[..., :M] > 0
    inside = torch.where(member, fit.gather(-1, cl.clamp(min=0)), False)
    sz.append((float(fit.sum(-1).float().mean()), float((inside | ~member).sum(-1).float().mean()),
               float((~fit & merged.valid).sum(-1).float().mean()), st.num_slots))
print("K, Nm, S, N (per head, mean over layers):", [round(sum(x[i] for x in sz) / len(sz)) for i in range(4)])
