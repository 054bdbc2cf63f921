"""Peak RSS of an 8k SmolLM2 prefill: plain transformers (DynamicCache, no kvcompress code in the
path) vs kvcompress chunked prefill (keep 0.25, chunks of 1024), each in its own subprocess.

    python rss.py --out rss.json              # from the repository root (its kvcompress is imported)

A subprocess (``--worker MODE``) loads SmolLM2 (float32, one thread), tokenizes 8192 tokens of the
Paul Graham essays, records its RSS (VmRSS) and peak (VmHWM) after loading, prefills through the
base model (no logits), and reports the peak again (VmHWM reset after loading through
/proc/self/clear_refs, so the peak is the prefill's, not the GGUF dequantization's). The full KV size of the prompt is computed
from the model's geometry (layers x 2 x KV heads x head_dim x 4 bytes x tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

TOKENS, KEEP, CHUNK = 8192, 0.25, 1024
ESSAYS = "/work/shared/data/paul_graham_essays"
MODES = ("plain", "chunked:semanticache-safe", "chunked:centroidkv")


def _status(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def worker(mode: str) -> dict:
    import torch

    torch.set_num_threads(1)
    import kvcompress
    from kvcompress.hf.loading import load_model

    model, tok = load_model()
    if mode == "plain":
        model.set_attn_implementation("sdpa")  # stock transformers attention: no kvcompress code in the path
    text = "\n\n".join(open(os.path.join(ESSAYS, f)).read() for f in sorted(os.listdir(ESSAYS)))
    ids = tok(text, return_tensors="pt").input_ids[:, :TOKENS]
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    full_kv = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * 4 * TOKENS
    loaded_rss, loaded_peak = _status("VmRSS"), _status("VmHWM")
    import gc

    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:  # reset VmHWM: the load's own peak (GGUF dequantizing) is not the prefill's
        f.write("5")
    reset_peak = _status("VmHWM")
    out = {"mode": mode, "tokens": int(ids.shape[1]), "full_kv_bytes": full_kv, "rss_after_load": loaded_rss,
           "peak_after_load": loaded_peak,
           "peak_after_reset": reset_peak, "attn_implementation": cfg._attn_implementation,
           "kvcompress_file": kvcompress.__file__}
    start = time.perf_counter()
    with torch.inference_mode():
        if mode == "plain":
            from transformers import DynamicCache

            cache = DynamicCache(config=cfg)
            model.base_model(input_ids=ids, use_cache=True, past_key_values=cache)
            held = sum(layer.keys.numel() * 4 * 2 for layer in cache.layers)
        else:
            from kvcompress.hf import CompressedCache

            preset = mode.split(":", 1)[1]
            cache = CompressedCache.for_model(model, tok, preset, backend="sdpa", keep_ratio=KEEP)
            cache.prefill(ids, chunk=CHUNK)
            held = cache.kv_bytes()
            out["slots_per_layer"] = cache.slots_per_layer()[:3]
            out["compress_s"] = cache.stats["compress_s"]
    out.update(prefill_s=time.perf_counter() - start, kv_bytes_held=held, peak=_status("VmHWM"),
               rss_end=_status("VmRSS"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker")
    ap.add_argument("--out", default="rss.json")
    ap.add_argument("--modes", default=",".join(MODES))
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker)))
        return
    runs = []
    if os.path.exists(args.out):
        runs = json.load(open(args.out)).get("runs", [])
    done = {r["mode"] for r in runs}
    for mode in args.modes.split(","):
        if mode in done:
            continue
        load = os.getloadavg()
        root = os.getcwd()  # the repository root: its kvcompress, not the venv's editable install
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", mode], capture_output=True,
                              text=True, env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": root})
        if proc.returncode:
            sys.exit(proc.stderr[-3000:])
        run = json.loads(proc.stdout.strip().splitlines()[-1])
        run["load_before"] = load
        run["load_after"] = os.getloadavg()
        runs.append(run)
        print(json.dumps(run), flush=True)
        summarize(runs, args.out)


def summarize(runs, path) -> None:
    plain = next((r for r in runs if r["mode"] == "plain"), None)
    MiB = 2 ** 20
    rows = []
    for r in runs:
        row = {"mode": r["mode"], "peak_MiB": round(r["peak"] / MiB, 1),
               "prefill_peak_minus_load_MiB": round((r["peak"] - r["rss_after_load"]) / MiB, 1),
               "kv_held_MiB": round(r["kv_bytes_held"] / MiB, 1), "prefill_s": round(r["prefill_s"], 1)}
        if plain is not None and r is not plain:
            saved = plain["peak"] - r["peak"]
            row["below_plain_MiB"] = round(saved / MiB, 1)
            row["below_plain_share_of_full_kv"] = round(saved / r["full_kv_bytes"], 3)
            row["target_met"] = saved >= 0.6 * r["full_kv_bytes"]
        rows.append(row)
    json.dump({"what": f"peak RSS (VmHWM) of a {TOKENS}-token SmolLM2-135M prefill, float32, 1 thread; plain = "
                       f"transformers DynamicCache; chunked = CompressedCache.prefill(chunk={CHUNK}) at keep {KEEP}; "
                       "target: below plain by >= 60% of the full KV size",
               "full_kv_MiB": round(runs[0]["full_kv_bytes"] / MiB, 1), "summary": rows, "runs": runs,
               "machine": {"cpus": os.cpu_count(), "uname": " ".join(os.uname())}},
              open(path, "w"), indent=1)


if __name__ == "__main__":
    main()
