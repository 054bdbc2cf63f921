"""How far can ONE slot per cluster go? A gradient oracle on captured SmolLM2 tensors (issue 14).

For each layer of a captured fidelity window (results/issue14-offline/capture.py), compress the prefix
with a preset (the fitted merger: its clusters and its fitted slots as the starting point), then let
Adam move every merged slot's key, bias and value (singletons stay exact) to minimise the very error
the offline study reports: the continuation's true queries attending over [compressed prefix + their
own causal keys], relative squared error of the outputs against the full cache's. The queries are
the ones the error is measured on (in-sample): no reference-query choice, weighting or closed form can
do better with the same clusters, so (mean - oracle) / mean bounds the cut any fit of these clusters
can give on this proxy. --train window instead fits by the same gradient descent to the window
queries' own outputs over the uncompressed prefix (what a fit can know), evaluated on the continuation.
    python results/issue14-oracle/oracle.py /tmp/h14/pg.pt --presets centroidkv-safe,semanticache-fixed64,centroidkv --budgets 0.25
"""
import argparse, json, os, sys, time
sys.path.insert(0, ".")
import torch
from kvcompress.types import KVState
from kvcompress.pipeline import Pipeline
from kvcompress.presets import get_preset
from kvcompress.config import StrategySpec

p = argparse.ArgumentParser()
p.add_argument("data")
p.add_argument("--presets", default="centroidkv-safe")
p.add_argument("--budgets", default="0.25")
p.add_argument("--steps", type=int, default=200)
p.add_argument("--lr", type=float, default=0.02)
p.add_argument("--R", type=int, default=32)
p.add_argument("--train", default="continuation", choices=["continuation", "window"])
p.add_argument("--out", default=None)
a = p.parse_args()
torch.set_num_threads(1)
data = torch.load(a.data)
scale, P0, vocab = data["scale"], data["prefix"], data["vocab"]
w = data["windows"][0]
Q, K, V, ids = w["q"], w["k"], w["v"], w["ids"]


def outputs(q, k, v, bias):
    H = k.shape[0]
    G = q.shape[0] // H
    qq = q.reshape(H, G, q.shape[1], -1)
    logits = torch.einsum("hgld,hnd->hgln", qq, k) * scale + bias[:, None]
    return torch.einsum("hgln,hnd->hgld", logits.softmax(-1), v).reshape(q.shape[0], q.shape[1], -1)


rows = []
for preset in a.presets.split(","):
    for budget in map(float, a.budgets.split(",")):
        errs = {"mean": [], "fitted": [], "oracle": []}
        t0 = time.perf_counter()
        for l in range(Q.shape[0]):
            qf = Q[l][:, P0:-1]
            C = qf.shape[1]
            kc, vc = K[l, :, P0:-1], V[l, :, P0:-1]
            causal = torch.full((C, C), float("-inf")).triu(1)
            Hk = K.shape[1]
            of = outputs(qf, torch.cat([K[l, :, :P0], kc], 1), torch.cat([V[l, :, :P0], vc], 1),
                         torch.cat([torch.zeros(Hk, C, P0), causal.expand(Hk, C, C)], -1))
            st = KVState.from_raw(K[l, :, :P0][None], V[l, :, :P0][None], token_ids=ids[None, :P0], vocab=vocab)
            st = st.replace(extras={"queries": Q[l][:, P0 - a.R:P0][None]})

            def err(keys, values, bias):
                k2, v2 = torch.cat([keys, kc], 1), torch.cat([values, vc], 1)
                b2 = torch.cat([bias[:, None].expand(Hk, C, -1), causal.expand(Hk, C, C)], -1)
                return (outputs(qf, k2, v2, b2) - of).square().sum() / of.square().sum()

            qw = Q[l][:, P0 - a.R:P0]
            ow = outputs(qw, K[l, :, :P0], V[l, :, :P0], torch.zeros(Hk, a.R, P0))

            def train_err(keys, values, bias):
                if a.train == "continuation":
                    return err(keys, values, bias)
                return (outputs(qw, keys, values, bias[:, None].expand(Hk, a.R, -1)) - ow).square().sum() / ow.square().sum()

            cfg = get_preset(preset, keep_ratio=budget)
            mean_state, _ = Pipeline(cfg).compress(st, layer_idx=l)
            fit_cfg = cfg.replace(merger=StrategySpec("fitted", {"queries": "window", "reference_queries": a.R}))
            fit_state, _ = Pipeline(fit_cfg).compress(st, layer_idx=l)
            errs["mean"].append(float(err(mean_state.keys[0], mean_state.values[0], mean_state.log_sizes[0])))
            errs["fitted"].append(float(err(fit_state.keys[0], fit_state.values[0], fit_state.log_sizes[0])))
            merged = (fit_state.token_counts()[0] > 1.5)  # [H, M] clusters of two tokens or more
            keys = fit_state.keys[0].clone().requires_grad_(True)
            values = fit_state.values[0].clone().requires_grad_(True)
            bias = fit_state.log_sizes[0].clone()
            finite = torch.isfinite(bias)
            bias_p = torch.where(finite, bias, 0.0).requires_grad_(True)
            opt = torch.optim.Adam([keys, values, bias_p], lr=a.lr)
            m3 = merged[..., None].float()
            k0, v0, b0 = keys.detach().clone(), values.detach().clone(), bias_p.detach().clone()
            best = errs["fitted"][-1]
            for step in range(a.steps):
                opt.zero_grad()
                kk = k0 + (keys - k0) * m3
                vv = v0 + (values - v0) * m3
                bb = torch.where(finite, b0 + (bias_p - b0) * merged.float(), float("-inf"))
                e = train_err(kk, vv, bb)
                e.backward()
                opt.step()
                if a.train == "continuation":
                    best = min(best, float(e.detach()))
            if a.train == "window":  # the slots after the last step, on the continuation
                with torch.no_grad():
                    best = float(err(k0 + (keys - k0) * m3, v0 + (values - v0) * m3,
                                     torch.where(finite, b0 + (bias_p - b0) * merged.float(), float("-inf"))))
            errs["oracle"].append(best)
        avg = {k: sum(v) / len(v) for k, v in errs.items()}
        row = {"preset": preset, "budget": budget, **{f"{k}_err": v for k, v in avg.items()},
               "fitted_cut": avg["fitted"] / avg["mean"] - 1, "oracle_cut": avg["oracle"] / avg["mean"] - 1,
               "train": a.train, "steps": a.steps, "lr": a.lr, "R": a.R, "seconds": time.perf_counter() - t0}
        rows.append(row)
        print(json.dumps(row), flush=True)
if a.out:
    json.dump({"rows": rows, "command": " ".join(sys.argv), "loadavg": os.getloadavg(), "window": w.get("sid")},
              open(a.out, "w"), indent=1)
