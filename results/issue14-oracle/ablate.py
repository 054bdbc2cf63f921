"""Where do the oracle's gains come from? Adam from the closed-form fit, training on the window queries'
own outputs over the uncompressed prefix (what a fit can know), with key / bias / value each frozen or
free; evaluated on the continuation's queries (output error relative to the full cache, as oracle.py).
    python results/issue14-oracle/ablate.py /tmp/h14/pg.pt --preset centroidkv-safe --budget 0.25
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
p.add_argument("--preset", default="centroidkv-safe")
p.add_argument("--budget", type=float, default=0.25)
p.add_argument("--steps", type=int, default=20)
p.add_argument("--lr", type=float, default=0.02)
p.add_argument("--R", type=int, default=32)
p.add_argument("--variants", default="kbv,k,b,v,bv,kb,kv")
p.add_argument("--fit", default="{}", help="extra fitted-merger params (json), e.g. '{\"refine\": 2}'")
p.add_argument("--layers", default=None)
p.add_argument("--fitted-preset", default=None, help="the fitted preset itself (its merger, rounds and window) + --fit params")
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


def refine(var, qw, ow, k, v, b, fit):
    """var: x<lam>[_k<steps>_<lr>]: joint ridge value solve over the head's window queries
    (fitted slots only, min-norm change); with _k: gradient steps on key and bias first."""
    parts = var[1:].split("_")
    sign = var.startswith("s")
    if sign:  # s<steps>_<lr>_<lam>[_<thr>]: sign-gradient steps on the key, then (lam >= 0) the value solve
        steps, lr, lam = int(parts[0]), float(parts[1]), float(parts[2])
        thr = float(parts[3]) if len(parts) > 3 else 0.0
    else:
      lam = float(parts[0])
      steps, lr = (int(parts[1][1:]), float(parts[2])) if len(parts) > 1 else (0, 0.0)
    H = k.shape[0]
    G = qw.shape[0] // H
    q = qw.reshape(H, G * qw.shape[1], -1)  # [H, P, D]
    o = ow.reshape(H, G * ow.shape[1], -1)
    f = fit.float()  # [H, M]
    k, v, b = k.clone(), v.clone(), b.clone()
    def attn(k, b):
        return (torch.einsum("hpd,hmd->hpm", q, k) * scale + b[:, None]).softmax(-1)
    def solve_v(A, v):
        Af = A * f[:, None]
        res = o - A @ v
        g = Af @ Af.transpose(1, 2)
        tr = g.diagonal(dim1=1, dim2=2).mean(-1)[:, None, None]
        x = torch.linalg.solve(g + lam * tr * torch.eye(g.shape[1]), res)
        return v + Af.transpose(1, 2) @ x
    for _ in range(steps):
        A = attn(k, b)
        out = A @ v
        g = out - o  # [H, P, D]
        c = A * (torch.einsum("hmd,hpd->hpm", v, g) - (out * g).sum(-1, keepdim=True))  # dL/ds
        c = c * f[:, None]
        gb = c.sum(1)
        gk = scale * c.transpose(1, 2) @ q
        if sign:
            big = gk.abs() > thr * gk.abs().amax(-1, keepdim=True)
            step = lr if lr > 0 else -lr / (scale * q.abs().sum(-1).mean(-1))[:, None, None]  # lr < 0: logit units
            if thr < 0:  # soft sign: g / (|g| + |thr| max|g|), continuous
                k = k - step * gk / (gk.abs() + (-thr) * gk.abs().amax(-1, keepdim=True)).clamp(min=1e-30)
            else:
                k = k - step * gk.sign() * big
            continue
        # normalised step: the largest slot moves lr in logit units
        hb = (A * f[:, None]).sum(1).clamp(min=1e-6)
        b = torch.where(torch.isfinite(b), b - lr * gb / hb, b)
        k = k - lr * gk / hb[..., None] / (scale * q.norm(dim=-1).mean(-1)[:, None, None]) ** 2
    if lam >= 0 if sign else (lam > 0 or steps == 0):
        v = solve_v(attn(k, b), v)
    return k, v, b


variants = a.variants.split(",") if a.variants else []
errs = {k: [] for k in ["mean", "fitted", *variants]}
layers = range(Q.shape[0]) if a.layers is None else [int(x) for x in a.layers.split(",")]
t0 = time.perf_counter()
fit_time = 0.0
for l in layers:
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
        return float((outputs(qf, k2, v2, b2) - of).square().sum() / of.square().sum())

    qw = Q[l][:, P0 - a.R:P0]
    ow = outputs(qw, K[l, :, :P0], V[l, :, :P0], torch.zeros(Hk, a.R, P0))
    cfg = get_preset(a.preset, keep_ratio=a.budget)
    mean_state, _ = Pipeline(cfg).compress(st, layer_idx=l)
    if a.fitted_preset:
        fit_cfg = get_preset(a.fitted_preset, keep_ratio=a.budget)
        fit_cfg = fit_cfg.replace(merger=StrategySpec("fitted", {**fit_cfg.merger.params, **json.loads(a.fit)}))
    else:
        fit_cfg = cfg.replace(merger=StrategySpec("fitted", {"queries": "window", "reference_queries": a.R, **json.loads(a.fit)}))
    t1 = time.perf_counter()
    fit_state, _ = Pipeline(fit_cfg).compress(st, layer_idx=l)
    fit_time += time.perf_counter() - t1
    errs["mean"].append(err(mean_state.keys[0], mean_state.values[0], mean_state.log_sizes[0]))
    errs["fitted"].append(err(fit_state.keys[0], fit_state.values[0], fit_state.log_sizes[0]))
    merged = (fit_state.token_counts()[0] > 1.5)
    m3 = merged[..., None].float()
    k0, v0 = fit_state.keys[0].clone(), fit_state.values[0].clone()
    b_in = fit_state.log_sizes[0]
    finite = torch.isfinite(b_in)
    b0 = torch.where(finite, b_in, 0.0)
    for var in variants:
        if var[0] in "xs":  # a cheap joint refinement prototype: see refine()
            kk, vv, bb = refine(var, qw, ow, k0, v0, b_in, merged)
            errs[var].append(err(kk, vv, bb))
            continue
        keys, values, bias_p = k0.clone().requires_grad_(True), v0.clone().requires_grad_(True), b0.clone().requires_grad_(True)
        params = [x for c, x in zip("kbv", (keys, bias_p, values)) if c in var]
        opt = torch.optim.Adam(params, lr=a.lr)
        def slots():
            kk = k0 + (keys - k0) * m3 if "k" in var else k0
            vv = v0 + (values - v0) * m3 if "v" in var else v0
            bb = torch.where(finite, b0 + (bias_p - b0) * merged.float(), float("-inf")) if "b" in var else b_in
            return kk, vv, bb
        for step in range(a.steps):
            opt.zero_grad()
            kk, vv, bb = slots()
            e = (outputs(qw, kk, vv, bb[:, None].expand(Hk, a.R, -1)) - ow).square().sum() / ow.square().sum()
            e.backward()
            opt.step()
        with torch.no_grad():
            errs[var].append(err(*slots()))
avg = {k: sum(v) / len(v) for k, v in errs.items()}
row = {"preset": a.preset, "fitted_preset": a.fitted_preset, "budget": a.budget, "fit": json.loads(a.fit),
       **{f"{k}_err": v for k, v in avg.items()},
       **{f"{k}_cut": avg[k] / avg["mean"] - 1 for k in avg if k != "mean"},
       "steps": a.steps, "lr": a.lr, "R": a.R, "fit_seconds": fit_time, "seconds": time.perf_counter() - t0}
print(json.dumps(row), flush=True)
if a.out:
    json.dump({"row": row, "command": " ".join(sys.argv), "loadavg": os.getloadavg(), "window": w.get("sid")},
              open(a.out, "w"), indent=1)
