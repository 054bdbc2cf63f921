"""Line-level thread CPU time of FittedMerger.refit and the fitting functions on real 8k layers (issue 14, session 11;
profile-s8/lines.py on what fit_plan receives in a pipeline).
    python results/issue14-cost/profile-s11/lines.py STATES.pt PRESET BUDGET [TOP]"""
import sys, time, os, collections, linecache, torch
sys.path.insert(0, ".")
from kvcompress.pipeline import Pipeline
from kvcompress.presets import get_preset
from kvcompress.strategies import fitted as FD, fitting as FT
torch.set_num_threads(1)
states = torch.load(sys.argv[1], weights_only=False)["states"]
caps = []
orig = FD.FittedMerger.fit_plan
FD.FittedMerger.fit_plan = lambda self, st, p, m: caps.append((st, p, m)) or m
pipe = Pipeline(get_preset(sys.argv[2], keep_ratio=float(sys.argv[3]))); pipe.prepare(states)
for l, st in enumerate(states): pipe.compress(st, layer_idx=l)
FD.FittedMerger.fit_plan = orig
m = pipe.merger
for c in caps: m.refit(*c)
T = time.thread_time
names = ("fit_clusters", "refine_jointly", "_attention", "row_part", "_weights", "split_moving", "_differs_from", "_compaction", "_compact")
targets = {FD.FittedMerger.refit.__code__} | {getattr(FT, n).__code__ for n in names if hasattr(FT, n)} | {getattr(FD, n).__code__ for n in names if hasattr(FD, n)}
acc = collections.Counter(); last = {}
def tracer(frame, event, arg):
    if frame.f_code not in targets and frame.f_code.co_name not in ("put", "compact", "stay", "attended_sum"): return None
    def local(frame, event, arg):
        now = T(); key = id(frame)
        if key in last:
            acc[last[key][1]] += now - last[key][0]
        if event == "return": last.pop(key, None); return local
        last[key] = (T(), (frame.f_code.co_filename, frame.f_lineno)); return local
    return local
t = T()
sys.settrace(tracer)
for c in caps: m.refit(*c)
sys.settrace(None)
total = (T() - t) / len(caps) * 1000
print(sys.argv[2:], f"refit traced {total:.1f} ms/layer; load {os.getloadavg()}")
for (f, line), v in acc.most_common(int(sys.argv[4]) if len(sys.argv) > 4 else 40):
    print(f"{v / len(caps) * 1000:6.2f} ms {os.path.basename(f)}:{line} {linecache.getline(f, line).strip()[:110]}")
