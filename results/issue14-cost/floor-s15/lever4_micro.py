import sys, torch, time, math
sys.path.insert(0, ".")
from kvcompress.pipeline import Pipeline
from kvcompress.presets import get_preset
from kvcompress.strategies import fitted as FD, fitting as F
torch.set_num_threads(1)
states = torch.load(sys.argv[1], weights_only=False)["states"][10:13]
T = time.thread_time
def t(f, r=15):
    f(); b = []
    for _ in range(r):
        a = T(); f(); b.append(T() - a)
    return sorted(b)[len(b) // 2] * 1e3
for spec in sys.argv[2:]:
    preset, budget = spec.split("@")
    caps = []
    FD.FittedMerger.fit_plan = lambda self, st, p, m: caps.append((st, p, m)) or m
    pipe = Pipeline(get_preset(preset, keep_ratio=float(budget))); pipe.prepare(states)
    for l, st in enumerate(states): pipe.compress(st, layer_idx=l)
    st, parent, merged = caps[-1]
    m = pipe.merger
    B, H, M = merged.log_sizes.shape; N = parent.shape[-1]; rows = B * H
    cluster = FD.cluster_index(parent); member = cluster >= 0
    k_in = st.keys.contiguous()
    differs = member & FD._differs_from(k_in, parent.clamp(min=0))
    out_row = FD._flat_index(torch.where(member, cluster, M), M + 1)
    fit = torch.zeros(rows * (M + 1)).index_add_(0, out_row, differs.reshape(-1).float()).view(B, H, M + 1)[:, :, :M] > 0
    stay_rows, stay_at, S, _ = FD._compaction(~fit)
    plan = FD._gather_plan(stay_rows, stay_at, rows * S)
    stay = lambda x, fill=0.0: FD._compact(x, plan, fill).view(B, H, S, *x.shape[3:])
    queries = FD.grouped_queries(st, FD.query_sources(m.queries), limit=m.reference_queries)
    scale = 1 / math.sqrt(st.head_dim)
    def overhead2():
        stay_bias = stay(merged.log_sizes.float(), F.NEG_INF)
        cnt = torch.zeros(rows * (M + 1), 2).index_add_(0, out_row, torch.stack([differs, member], -1).reshape(-1, 2).float())
        size = cnt[:, 1]
        stay_size = stay(size.view(B, H, M + 1)[:, :, :M])
        single = stay_size == 1
        ok = bool((single | ((stay_size == 0) & (stay_bias == F.NEG_INF))).all())
        slot = torch.full((rows * (M + 1),), -1, dtype=torch.long).index_copy_(0, out_row, torch.arange(N).expand(B, H, N).reshape(-1))
        return torch.where(single, stay(slot.view(B, H, M + 1)[:, :, :M], -1), -1)
    def fitcount():
        return torch.zeros(rows * (M + 1)).index_add_(0, out_row, differs.reshape(-1).float()).view(B, H, M + 1)[:, :, :M] > 0
    def overhead():
        stay_bias = stay(merged.log_sizes.float(), F.NEG_INF)
        size = torch.zeros(rows * (M + 1)).index_add_(0, out_row, member.reshape(-1).float())
        stay_size = stay(size.view(B, H, M + 1)[:, :, :M])
        single = stay_size == 1
        ok = bool((single | ((stay_size == 0) & (stay_bias == F.NEG_INF))).all())
        rep = member & (parent == torch.arange(N))
        slot = torch.full((rows * (M + 1),), -1, dtype=torch.long).index_copy_(0, FD._flat_index(torch.where(rep, cluster, M), M + 1), torch.arange(N).expand(B, H, N).reshape(-1))
        return torch.where(single, stay(slot.view(B, H, M + 1)[:, :, :M], -1), -1)
    slots = overhead()
    vals = stay(merged.values)
    # the fit's e, as fit_clusters makes it
    q_t = F._scaled_t(queries, scale)
    s = torch.matmul(k_in.float(), q_t); top = F._max_over_slots(s); e = s.sub_(top).exp_()
    e_flat = e.view(rows * N, -1)
    print(spec, "S", S, "P", queries.shape[2], "overhead %.2f" % t(overhead), "overhead2 %.2f" % t(overhead2), "fit count %.2f" % t(fitcount), "same", torch.equal(overhead(), overhead2()), "rest_of %.2f" % t(lambda: F._rest_of(e_flat, top[:, :, 0], slots, vals)),
          "row_part %.2f" % t(lambda: F.row_part(stay(merged.keys), vals, stay(merged.log_sizes.float(), F.NEG_INF), queries, scale)),
          "stay keys+bias compaction %.2f" % t(lambda: (stay(merged.keys), stay(merged.log_sizes.float(), F.NEG_INF))), flush=True)
