"""The working tree's fitted merger against an older copy on real 8k layers (issue 14, session 14): profile-s12/ab2.py
(inputs captured once per preset, every layer refitted by new and old in alternating order, thread CPU time summed
per repeat, median of the per-repeat ratios new / old) plus the change's effect on fidelity: the relative attention
output error sum_r |o'_r - o_r|^2 / sum_r |o_r|^2 of the refitted layer (every slot, bias = log_sizes) against
the uncompressed layer over the fit's reference queries ("ref") and over the whole captured 64-query window
("win"), summed over the 30 layers, for new and old.
    python results/issue14-cost/profile-s14/ab3.py STATES.pt OLD_DIR REPEATS PRESET@BUDGET ...
OLD_DIR as for profile-s11/ab.py (fitted_old.py / fitting_old.py). PRESET@BUDGET@k=v,k=v: the new merger with
those parameters overridden (e.g. query_stride=2), the old one as registered."""
import sys, time, os, math, statistics, torch
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

def attend(st, q):  # q [B, H, P, D] grouped -> [B, H, P, D] float64
    k, v, b = st.keys.double(), st.values.double(), st.log_sizes.double()
    s = torch.matmul(q.double(), k.transpose(-1, -2)) / math.sqrt(k.shape[-1]) + b[:, :, None]
    return torch.matmul(torch.softmax(s, -1), v)

def err(st, out, q):
    want, got = attend(st, q), attend(out, q)
    return float((got - want).square().sum()), float(want.square().sum())

for spec in sys.argv[4:]:
    preset, budget, *over = spec.split("@")
    over = {k: (int(v) if v.isdigit() else float(v)) for k, v in (kv.split("=") for kv in over[0].split(","))} if over else {}
    caps = []
    FD.FittedMerger.fit_plan = lambda self, st, p, m: caps.append((st, p, m)) or m
    pipe = Pipeline(get_preset(preset, keep_ratio=float(budget))); pipe.prepare(states)
    for l, st in enumerate(states): pipe.compress(st, layer_idx=l)
    FD.FittedMerger.fit_plan = orig
    old = OLD.FittedMerger(**asdict(pipe.merger))
    new = FD.FittedMerger(**{**asdict(pipe.merger), **over})
    worst = {"keys": 0.0, "values": 0.0, "log_sizes": 0.0}
    e = {"new": {"ref": [0.0, 0.0], "win": [0.0, 0.0]}, "old": {"ref": [0.0, 0.0], "win": [0.0, 0.0]}}
    for c in caps:
        a, b = new.refit(*c), old.refit(*c)
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
    rel = {k: {q: v[0] / v[1] for q, v in d.items()} for k, d in e.items()}
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
          f"{ {k: f'{v:.1e}' for k, v in worst.items()} }; rel output error ref new/old "
          f"{rel['new']['ref']:.6e}/{rel['old']['ref']:.6e} win {rel['new']['win']:.6e}/{rel['old']['win']:.6e}; "
          f"load {os.getloadavg()}", flush=True)
