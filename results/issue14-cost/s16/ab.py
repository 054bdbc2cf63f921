"""The working tree's fitted merger against main's (c51535c) on cached real 8k layers (caps.py), issue 14 session 16.
Per preset and budget: every layer refitted by new and old back to back, the order alternating by layer and
repeat, thread CPU time summed per repeat, the median of the per-repeat ratios new / old; the largest relative
difference of the fitted slots (0 = bit-identical); the relative attention-output error sum|o'-o|^2 / sum|o|^2 of
the refitted layer against the uncompressed one over the fit's queries ("ref") and the whole captured 64-query
window ("win"), summed over the layers. Both arms get fresh clones of merged's tensors (made outside the timing,
as a round's merge makes them); the new arm is told it owns them (refit(..., owned=True): the pipeline's call).
    python results/issue14-cost/s16/ab.py OLD_DIR REPEATS PRESET@BUDGET[@k=v,k=v] ...
OLD_DIR: fitted_old.py / fitting_old.py (profile-s11/ab.py); k=v overrides the new arm's merger parameters."""
import sys, time, os, math, statistics, inspect, torch
sys.path.insert(0, "."); sys.path.insert(0, sys.argv[1])
from kvcompress.strategies import fitted as FD
import fitted_old as OLD
torch.set_num_threads(1)
reps = int(sys.argv[2])
T = time.thread_time
OWNED = "owned" in inspect.signature(FD.FittedMerger.refit).parameters

def attend(st, q):  # q [B, H, P, D] grouped -> [B, H, P, D] float64
    k, v, b = st.keys.double(), st.values.double(), st.log_sizes.double()
    s = torch.matmul(q.double(), k.transpose(-1, -2)) / math.sqrt(k.shape[-1]) + b[:, :, None]
    return torch.matmul(torch.softmax(s, -1), v)

def err(st, out, q):
    want, got = attend(st, q), attend(out, q)
    return float((got - want).square().sum()), float(want.square().sum())

def fresh(m):
    return m.replace(keys=m.keys.clone(), values=m.values.clone(), log_sizes=m.log_sizes.clone())

def run(merger, c, new):
    st, p, m = c
    return merger.refit(st, p, m, owned=True) if new and OWNED else merger.refit(st, p, m)

for spec in sys.argv[3:]:
    preset, budget, *over = spec.split("@")
    over = {k: (int(v) if v.isdigit() else float(v)) for k, v in (kv.split("=") for kv in over[0].split(","))} if over else {}
    d = torch.load(f"/tmp/h14b/caps-{preset}-{budget}.pt", weights_only=False)
    caps = d["caps"]
    old = OLD.FittedMerger(**d["merger"])
    new = FD.FittedMerger(**{**d["merger"], **over})
    worst = {"keys": 0.0, "values": 0.0, "log_sizes": 0.0}
    e = {"new": {"ref": [0.0, 0.0], "win": [0.0, 0.0]}, "old": {"ref": [0.0, 0.0], "win": [0.0, 0.0]}}
    for c in caps:
        a = run(new, (c[0], c[1], fresh(c[2])), True)
        b = run(old, (c[0], c[1], fresh(c[2])), False)
        st = c[0]
        qref = FD.grouped_queries(st, FD.query_sources(new.queries), limit=new.reference_queries, stride=new.query_stride)
        qwin = FD.grouped_queries(st, (FD.WINDOW_QUERIES,))
        for name, o in (("new", a), ("old", b)):
            for qn, q in (("ref", qref), ("win", qwin)):
                x, y = err(st, o, q); e[name][qn][0] += x; e[name][qn][1] += y
        for n in worst:
            x, y = getattr(a, n), getattr(b, n)
            assert x.dtype == y.dtype and x.shape == y.shape and bool((torch.isfinite(x) == torch.isfinite(y)).all()), n
            if not torch.equal(x, y):
                x, y = x.double(), y.double(); fin = torch.isfinite(y)
                worst[n] = max(worst[n], float((x - y).abs()[fin].max() / y.abs()[fin].max().clamp(min=1e-30)))
    rel = {k: {q: v[0] / v[1] for q, v in dd.items()} for k, dd in e.items()}
    ratios, tn, to = [], [], []
    load0 = os.getloadavg()
    for r in range(reps):
        sn = so = 0.0
        for i, c in enumerate(caps):
            for mm in ((new, old) if (r + i) % 2 == 0 else (old, new)):
                x = (c[0], c[1], fresh(c[2]))
                t = T(); run(mm, x, mm is new); dt = T() - t
                if mm is new: sn += dt
                else: so += dt
        ratios.append(sn / so); tn.append(sn / len(caps) * 1000); to.append(so / len(caps) * 1000)
    print(f"{spec}: ms/layer new {statistics.median(tn):.1f} old {statistics.median(to):.1f}; ratio median "
          f"{statistics.median(ratios):.3f} (per repeat {' '.join(f'{x:.3f}' for x in ratios)}); largest relative difference "
          f"{ {k: f'{v:.1e}' for k, v in worst.items()} }; rel output error ref new/old "
          f"{rel['new']['ref']:.6e}/{rel['old']['ref']:.6e} win {rel['new']['win']:.6e}/{rel['old']['win']:.6e}; "
          f"load {load0} -> {os.getloadavg()}", flush=True)
