"""Layer-local fidelity of merged caches on captured SmolLM2 tensors (offline study for issue 14).

For each window and layer: compress the prefix's KV with a preset (mean merger vs fitted variants),
then let the continuation's true queries attend over [compressed prefix + their own uncompressed
keys] (causal) and compare the outputs with the full cache's: relative squared error, summed over
positions, heads and layers.
    python results/issue14-offline/study.py /tmp/h14/pg.pt --presets centroidkv --budgets 0.5,0.25
"""
import argparse, json, math, sys, time
sys.path.insert(0, ".")
import torch
import torch.nn.functional as F
from kvcompress.types import KVState
from kvcompress.pipeline import Pipeline
from kvcompress.presets import get_preset
from kvcompress.config import StrategySpec

p = argparse.ArgumentParser()
p.add_argument("data")
p.add_argument("--presets", default="centroidkv")
p.add_argument("--budgets", default="0.5,0.25")
p.add_argument("--variants", default='{"mean": null, "fitted": {}}')
p.add_argument("--R", type=int, default=64)
p.add_argument("--layers", default=None)
p.add_argument("--out", default=None)
p.add_argument("--per-layer", action="store_true")
p.add_argument("--windows", type=int, default=None)
p.add_argument("--query-window", type=int, default=32, help="last prefill queries given as extras['queries']")
a = p.parse_args()
torch.set_num_threads(1)
data = torch.load(a.data)
scale, P0, vocab = data["scale"], data["prefix"], data["vocab"]
variants = json.loads(a.variants)


def outputs(q, k, v, bias):
    """q [Hq, L, D] against k/v [H, N, D] with bias [H, L, N] -> [Hq, L, D]."""
    H = k.shape[0]
    G = q.shape[0] // H
    qq = q.reshape(H, G, q.shape[1], -1)
    logits = torch.einsum("hgld,hnd->hgln", qq, k) * scale + bias[:, None]
    return torch.einsum("hgln,hnd->hgld", logits.softmax(-1), v).reshape(q.shape[0], q.shape[1], -1)


def stride_idx(T, R):
    return torch.linspace(0, T - 1, R).round().long()


results = {}
for preset in a.presets.split(","):
    for budget in map(float, a.budgets.split(",")):
        for vname, vparams in variants.items():
            num = den = 0.0
            per_layer = []
            t_compress = 0.0
            for w in data["windows"][: a.windows]:
                Q, K, V, ids = w["q"], w["k"], w["v"], w["ids"]
                L = Q.shape[0]
                layers = range(L) if a.layers is None else [int(x) for x in a.layers.split(",")]
                for l in layers:
                    cfg = get_preset(preset, keep_ratio=budget)
                    R = a.R
                    oracle = False
                    if vparams is not None:
                        vp = dict(vparams)
                        R = vp.pop("_R", a.R)
                        oracle = vp.pop("_oracle", False)
                        cfg = cfg.replace(merger=StrategySpec("fitted", vp))
                    pipe = Pipeline(cfg)
                    st = KVState.from_raw(K[l, :, :P0][None], V[l, :, :P0][None], token_ids=ids[None, :P0], vocab=vocab)
                    ref = Q[l][:, stride_idx(P0, R)][None]
                    if oracle:  # the continuation's own queries (what the fit would want to know)
                        ref = Q[l][:, P0:-1][None]
                    extras = {"reference_queries": ref, "queries": Q[l][:, P0 - a.query_window:P0][None],
                              "reference_positions": stride_idx(P0, R)}
                    st = st.replace(extras=extras)
                    t = time.perf_counter()
                    cs, rep = pipe.compress(st, layer_idx=l)
                    t_compress += time.perf_counter() - t
                    qf = Q[l][:, P0:-1]  # continuation queries [Hq, C, D]
                    C = qf.shape[1]
                    kc, vc = K[l, :, P0:-1], V[l, :, P0:-1]
                    causal = torch.full((C, C), float("-inf")).triu(1)
                    Hk = K.shape[1]
                    # full
                    kf = torch.cat([K[l, :, :P0], kc], 1)
                    vf = torch.cat([V[l, :, :P0], vc], 1)
                    bf = torch.cat([torch.zeros(Hk, C, P0), causal.expand(Hk, C, C)], -1)
                    of = outputs(qf, kf, vf, bf)
                    k2 = torch.cat([cs.keys[0], kc], 1)
                    v2 = torch.cat([cs.values[0], vc], 1)
                    b2 = torch.cat([cs.log_sizes[0][:, None].expand(Hk, C, -1), causal.expand(Hk, C, C)], -1)
                    oc = outputs(qf, k2, v2, b2)
                    e = float((oc - of).square().sum()) / float(of.square().sum())
                    per_layer.append(e)
            results[(preset, budget, vname)] = (sum(per_layer) / len(per_layer), t_compress)
            if a.per_layer:
                print(vname, " ".join(f"{x:.4f}" for x in per_layer))
            print(f"{preset:24s} {budget:5.2f} {vname:12s} rel.sq.err {sum(per_layer)/len(per_layer):.5f}  compress {t_compress:.1f}s", flush=True)
if a.out:
    json.dump([{"preset": k[0], "budget": k[1], "variant": k[2], "err": v[0], "compress_s": v[1]} for k, v in results.items()],
              open(a.out, "w"), indent=1)
