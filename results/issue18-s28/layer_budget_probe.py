"""Would per-layer budgets help? (session 28 dev probe, diagnosis only; nothing in the library changes)

`kvzip-copy-heads-noquery` keeps its question-free sentences in the 5 % of (layer, KV head) pairs that copy, and
there they take the room the continuation's own needs (SnapKV's window choice) would use: on a fidelity window of
seed 19 ("Default Alive or Default Dead?") the sentences in the copy heads are the whole loss against SnapKV
(guard share 0: KL 0.125 -> 0.030, SnapKV 0.028). The layers holding a copy head could keep more slots and the
others fewer, at the same total memory. This probe builds that cache from the public API: the snapshot compressed
twice, at keep k * s (the copy-head layers; the guard's ``allowance_keep`` 0.25 keeps the sentences' allowance
where it was, so the extra slots go to SnapKV's window choice) and at keep k' for the other layers with
c * k * s + (L - c) * k' = L * k; the two caches' layer states assembled into one (``CompressedCache.from_states``),
no decode-time recompression (the eval's fidelity task feeds the continuation without any).

    python results/issue18-s28/layer_budget_probe.py --seeds 19 --samples 8 --scales 1.5,2 \
        --out results/issue18-s28/layer-budget-s19.jsonl
"""

import argparse
import json
import time

import torch

from kvcompress.eval.caches import compressed_copy, Recorder
from kvcompress.eval.data import Haystack
from kvcompress.eval.fidelity import compare, fidelity_windows, teacher_forced_logits
from kvcompress.eval.reconstruction import copy_for
from kvcompress.hf import CompressedCache
from kvcompress.hf.loading import load_model
from kvcompress.pipeline import Pipeline
from kvcompress.presets import get_preset
from kvcompress.strategies.importance import copy_of

PG = "/work/shared/data/paul_graham_essays"
PRESET = "kvzip-copy-heads-noquery"


def copy_layers(states, share: float = 0.05) -> list[int]:
    """Layers holding at least one of the top ``share`` (layer, KV head) pairs by copy score (batch row 0)."""
    x = torch.stack([copy_of(st)[0] for st in states])  # [L, H]
    k = int(-(-share * x.numel() // 1))
    thr = x.flatten().topk(k).values[-1]
    return sorted({int(i) for i in (x >= thr).nonzero()[:, 0]})


def rect_slots(cache) -> int:
    """Slots the compressed layers' tensors hold per row and head, padding of shorter heads included."""
    return sum(cache.slots_per_layer())


def kl_of(model, cache, cont, ref_logits, targets):
    cache.enabled = False
    try:
        return compare(ref_logits, teacher_forced_logits(model, cache, cont, None), targets)
    finally:
        cache.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="19")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--only", default=None, help="comma-separated sample indices")
    ap.add_argument("--budget", type=float, default=0.25)
    ap.add_argument("--scales", default="1.5,2")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    model, tok = load_model()
    hay = Haystack.load(PG)
    k = a.budget
    scales = [float(s) for s in a.scales.split(",")]
    only = None if a.only is None else {int(x) for x in a.only.split(",")}
    with open(a.out, "a") as out:
        for seed in [int(s) for s in a.seeds.split(",")]:
            windows = fidelity_windows(tok, hay, 2048, 256, a.samples, seed=seed)
            for idx, (sid, ids) in enumerate(windows):
                if only is not None and idx not in only:
                    continue
                t0 = time.time()
                base = get_preset(PRESET, keep_ratio=k, on_infeasible="best_effort")
                snap_cfg = get_preset("snapkv", keep_ratio=k, on_infeasible="best_effort")
                rec = Recorder.for_configs(model, tok, [base, snap_cfg])
                try:
                    rec.feed(ids[:, :2048])
                    snap = rec.snapshot()
                    cont = ids[:, 2048:-1]
                    ref = rec.feed(cont, logits=True)[0].float()
                finally:
                    rec.close()
                targets = ids[0, 2049:]
                row = {"seed": seed, "sample": sid, "budget": k}
                c0 = copy_for(model, tok, snap, base)  # attaches the reconstruction pass to the snapshot
                row["full_slots"] = len(c0.cache.compressed_layer_ids()) * 2048
                row["noquery_slots"] = rect_slots(c0.cache)
                row["noquery"] = kl_of(model, c0.cache, cont, ref, targets)["kl"]
                cs = copy_for(model, tok, snap, snap_cfg)
                row["snapkv_slots"] = rect_slots(cs.cache)
                row["snapkv"] = kl_of(model, cs.cache, cont, ref, targets)["kl"]
                layers = copy_layers(snap.states)
                L = len(snap.states)
                row["copy_layers"] = layers
                for s in scales:
                    c = len(layers)
                    k_hi = min(k * s, 1.0)
                    k_lo = (L * k - c * k_hi) / (L - c)
                    hi = compressed_copy(model, snap, get_preset(PRESET, keep_ratio=k_hi, on_infeasible="best_effort"))
                    lo = compressed_copy(model, snap, get_preset(PRESET, keep_ratio=k_lo, on_infeasible="best_effort"))
                    states = [(hi if i in layers else lo).cache.layer_state(i) for i in range(L)]
                    pipe = Pipeline(get_preset(PRESET, keep_ratio=k, on_infeasible="best_effort"))
                    mixed = CompressedCache.from_states(states, pipe, vocab=snap.vocab, backend=snap.backend,
                                                        geometry=snap.geometry, model=model)
                    hi.cache.close()
                    lo.cache.close()
                    row[f"x{s:g}_slots"] = rect_slots(mixed)
                    row[f"x{s:g}_k_lo"] = round(k_lo, 4)
                    row[f"x{s:g}"] = kl_of(model, mixed, cont, ref, targets)["kl"]
                row["seconds"] = round(time.time() - t0, 1)
                out.write(json.dumps(row) + "\n")
                out.flush()
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
