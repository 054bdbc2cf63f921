"""Line-level CPU time (thread_time between line events) of FittedMerger.refit and the fitting functions on
captured states: python results/issue14-cost/profile-s8/lines.py CAPTURE.pt REFINE"""
import sys, time, torch, collections, linecache
sys.path.insert(0, ".")
from kvcompress.strategies.fitted import FittedMerger
import kvcompress.strategies.fitting as FT, kvcompress.strategies.fitted as FD
torch.set_num_threads(1)
caps = torch.load(sys.argv[1], weights_only=False)
refine = int(sys.argv[2])
m = FittedMerger(queries="window", reference_queries=32, refine=refine)
for c in caps: m.refit(*c)
T = time.thread_time
ts = []
for rep in range(3):
    t = T()
    for c in caps: m.refit(*c)
    ts.append((T() - t) / len(caps) * 1000)
print("refit ms/layer", [round(x, 1) for x in ts])
targets = {FT.fit_clusters.__code__, FT.refine_jointly.__code__, FD.FittedMerger.refit.__code__, FT._attention.__code__, FT.row_part.__code__, FT._weights.__code__}
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
for (f, l), t in sorted(acc.items(), key=lambda x: -x[1])[:30]:
    print(f"{t/n*1000:7.2f} ms  {f.split('/')[-1]}:{l}  {linecache.getline(f, l).strip()[:110]}")
print("total traced", sum(acc.values())/n*1000)
