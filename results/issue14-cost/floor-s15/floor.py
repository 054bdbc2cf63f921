"""The fit's floor at 8k (issue 14, session 15): per layer, the shapes the fit actually uses (wrapped calls of
fit_clusters / row_part / split_moving / refine_jointly on real captures), the FLOPs of its products and the
float32 time of each product alone (1 thread, min of repeats, random data of those shapes), as shares of the plain
8k prefill (4.06 TFLOP; its CPU time from cost-s14-main.json). Also the time of one elementwise pass over the
[H, N, P] logits (exp_ in place), the unit of the fit's non-product work, and the bf16 times of the two N x P
products (torch CPU bf16 matmul, bf16 out).
    python results/issue14-cost/floor-s15/floor.py STATES.pt OUT.json PRESET@BUDGET ..."""
import sys, time, os, json, statistics, torch
sys.path.insert(0, ".")
from kvcompress.pipeline import Pipeline
from kvcompress.presets import get_preset
from kvcompress.strategies import fitted as FD
torch.set_num_threads(1)
PREFILL_FLOP, PREFILL_S, LAYERS = 4.06e12, 55.62146287899999, 30
states = torch.load(sys.argv[1], weights_only=False)["states"]
orig = FD.FittedMerger.fit_plan
shapes = {}
def wrap(name, get):
    f = getattr(FD, name)
    def g(*a, **k):
        shapes.setdefault(name, []).append(get(*a, **k)); return f(*a, **k)
    setattr(FD, name, g); return f
originals = {
    "fit_clusters": wrap("fit_clusters", lambda keys, v, b, cl, q, pk, *a, **k: dict(
        H=keys.shape[1], N=keys.shape[2], D=keys.shape[3], P=q.shape[2], K=pk.shape[2],
        members=int((cl >= 0).sum()), key=k.get("key"))),
    "row_part": wrap("row_part", lambda keys, v, b, q, s: dict(S=keys.shape[2], P=q.shape[2])),
    "split_moving": wrap("split_moving", lambda keys, *a, **k: dict(K=keys.shape[2])),
    "refine_jointly": wrap("refine_jointly", lambda keys, v, b, rest, q, t, **k: dict(T=keys.shape[2], P=q.shape[2], steps=k["steps"])),
}

def best(f, r=7):
    f(); out = []
    for _ in range(r):
        t = time.thread_time(); f(); out.append(time.thread_time() - t)
    return min(out)

def mm_time(H, a, b, c, trans=False, dtype=torch.float32):
    """[H, a, b] @ [H, b, c]; trans: the left operand a transposed view of [H, b, a] (as _numerators' v^T)."""
    x = torch.randn(H, b, a).to(dtype).transpose(-1, -2) if trans else torch.randn(H, a, b).to(dtype)
    y = torch.randn(H, b, c).to(dtype)
    return best(lambda: torch.matmul(x, y))

report = {"what": __doc__.split("\n")[0], "prefill_flop": PREFILL_FLOP, "prefill_cpu_s": PREFILL_S, "presets": {}}
for spec in sys.argv[3:]:
    preset, budget = spec.split("@")
    caps = []
    FD.FittedMerger.fit_plan = lambda self, st, p, m: caps.append((st, p, m)) or m
    pipe = Pipeline(get_preset(preset, keep_ratio=float(budget))); pipe.prepare(states)
    for l, st in enumerate(states): pipe.compress(st, layer_idx=l)
    FD.FittedMerger.fit_plan = orig
    shapes.clear()
    for c in caps: pipe.merger.refit(*c)
    L = len(caps)
    fc = shapes["fit_clusters"]; rp = shapes.get("row_part", []); sm = shapes.get("split_moving", []); rj = shapes.get("refine_jointly", [])
    med = lambda xs, k: int(round(statistics.median(x[k] for x in xs))) if xs else 0
    H, N, D, P = fc[0]["H"], fc[0]["N"], fc[0]["D"], fc[0]["P"]
    K, Mem, S, Km, T, steps = med(fc, "K"), med(fc, "members"), med(rp, "S"), med(sm, "K"), med(rj, "T"), (rj[0]["steps"] if rj else 0)
    # products per layer: (name, FLOPs, (H, a, b, c, trans)) for [H, a, b] @ [H, b, c]
    prods = [("logits N x P", 2 * H * N * P * D, (H, N, D, P, False)),
             ("numerators N x P", 2 * H * N * P * D, (H, D, N, P, True)),
             ("a = e z^-1 (N x P vector)", 2 * H * N * P, (H, N, P, 1, False)),
             ("slot logits K x P", 2 * H * K * P * D, (H, K, D, P, False)),
             ("value fit K x P", 2 * H * K * P * D, (H, K, P, D, False))]
    if S:
        prods += [("row_part logits S x P", 2 * H * S * P * D, (H, S, D, P, False)),
                  ("row_part numerators S x P", 2 * H * S * P * D, (H, D, S, P, True))]
    if Km:
        prods += [("split_moving attention K x P vector", 2 * H * Km * P, (H, Km, P, 1, False)),
                  ("split_moving numerators K x P", 2 * H * Km * P * D, (H, D, Km, P, True))]
    if T:
        n_att = steps + 1
        prods += [("refine logits T x P (steps)", 2 * H * T * P * D * steps, (H, T, D, P, False), steps),
                  ("refine numerators T x P (steps+1)", 2 * H * T * P * D * n_att, (H, D, T, P, True), n_att),
                  ("refine c = v g^T (steps)", 2 * H * T * P * D * steps, (H, T, D, P, False), steps),
                  ("refine grad c q (steps)", 2 * H * T * P * D * steps, (H, T, P, D, False), steps),
                  ("refine gram a^T a", 2 * H * P * P * T, (H, P, T, P, True)),
                  ("refine a x", 2 * H * T * P * D, (H, T, P, D, False))]
    rows = []
    for pr in prods:
        name, flop, shp = pr[:3]; times = pr[3] if len(pr) > 3 else 1
        rows.append({"product": name, "gflop_per_layer": flop / 1e9, "ms_per_layer_f32": 1e3 * times * mm_time(*shp)})
    members_flop = 2 * Mem * P + (4 if fc[0]["key"] != "mean" else 2) * Mem * D  # mass + sum_v (+ sum_k)
    ew = torch.randn(H, N, P)
    pass_ms = 1e3 * best(lambda: ew.exp_().clamp_(max=1.0))  / 2  # one in-place pass (two ops / 2)
    bf = {"logits N x P bf16": 1e3 * mm_time(H, N, D, P, False, torch.bfloat16), "numerators N x P bf16": 1e3 * mm_time(H, D, N, P, True, torch.bfloat16)}
    gflop = sum(r["gflop_per_layer"] for r in rows) + members_flop / 1e9
    ms = sum(r["ms_per_layer_f32"] for r in rows)
    big = sum(r["ms_per_layer_f32"] for r in rows[:2])
    out = {"shapes": dict(H=H, N=N, D=D, P=P, K_fitted_per_head=K, members=Mem, S_stay_per_head=S, T_moving_per_head=T,
                          refine_steps=steps, layers=L),
           "products": rows, "member_sums_gflop_per_layer": members_flop / 1e9,
           "total_gflop_per_layer": gflop, "flop_share_of_prefill": gflop * 1e9 * L / PREFILL_FLOP,
           "products_ms_per_layer_f32": ms, "products_share_of_prefill_cpu": ms / 1e3 * L / PREFILL_S,
           "two_NxP_products_ms_f32": big, "one_elementwise_pass_over_NxP_ms": pass_ms,
           "bf16_ms": bf, "two_NxP_products_share_bf16": sum(bf.values()) / 1e3 * L / PREFILL_S,
           "two_percent_budget_ms_per_layer": 0.02 * PREFILL_S / L * 1e3, "load": os.getloadavg()}
    report["presets"][spec] = out
    print(spec, json.dumps(out, indent=1), flush=True)
json.dump(report, open(sys.argv[2], "w"), indent=1)
