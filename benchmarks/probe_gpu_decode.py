"""Why decode attention is slow on a GPU: the library's two backends against layouts and kernels
that could replace them, one decode query (L=1) over N cached slots, bf16, per KV geometry.

    python benchmarks/probe_gpu_decode.py --out /tmp/probe.json          # needs CUDA
    python benchmarks/probe_gpu_decode.py --device cpu --lengths 512     # smoke test

Variants (each: mean ms of --reps back-to-back calls, max |error| against a float64 reference):
  stock        F.scaled_dot_product_attention(enable_gqa=True), no bias: the floor a mask forbids
  lib_sdpa     kvcompress.attention.proportional_attention (float32 upcast, float mask)
  sdpa_bf16    SDPA in the cache dtype with the bias as a [B, H_q, L, N] mask of that dtype
  matmul       explicit matmuls in the cache dtype, float32 softmax
  lib_flex     kvcompress.flex.flex_proportional_attention (enable_gqa, N dynamic)
  flex_static  the same score_mod compiled for the exact shapes
  flex_folded  the G query heads of a KV head folded into the query length (no enable_gqa), N dynamic
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

GEOMETRIES = {"llama3-8b": (8, 4, 128), "smollm2-135m": (3, 3, 64)}  # (H_kv, groups, head dim)


def timed(fn, device, reps: int) -> float:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps * 1e3


def _gqa_kernel(q, k, v, bias, groups: int, scale: float):
    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[b, h // groups, kv_idx]
    return flex_attention(q, k, v, score_mod=score_mod, scale=scale, enable_gqa=True)


def _folded_kernel(q, k, v, bias, scale: float):
    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[b, h, kv_idx]
    return flex_attention(q, k, v, score_mod=score_mod, scale=scale)


def variants(q, k, v, ls, scale):
    from kvcompress.attention import proportional_attention
    from kvcompress.flex import flex_proportional_attention

    B, Hq, L, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    G = Hq // Hkv
    mask = ls[:, :, None, :].repeat_interleave(G, dim=1).to(q.dtype)  # [B, H_q, 1, N]
    qf = q.reshape(B, Hkv, G * L, D)
    gqa_static = torch.compile(_gqa_kernel, fullgraph=True, dynamic=False)
    folded = torch.compile(_folded_kernel, fullgraph=True, dynamic=False)

    def matmul():
        s = torch.matmul(qf, k.transpose(-1, -2)).float() * scale + ls[:, :, None, :]
        return torch.matmul(s.softmax(-1).to(v.dtype), v).reshape(B, Hq, L, -1)

    def flex_folded():
        for t in (k, v, ls):
            torch._dynamo.maybe_mark_dynamic(t, 2)
        return folded(qf, k, v, ls, scale).reshape(B, Hq, L, -1)

    return {
        "stock": lambda: F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True),
        "lib_sdpa": lambda: proportional_attention(q, k, v, ls, causal=False, scale=scale),
        "sdpa_bf16": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True),
        "matmul": matmul,
        "lib_flex": lambda: flex_proportional_attention(q, k, v, ls, causal=False, scale=scale),
        "flex_static": lambda: gqa_static(q, k, v, ls, G, scale),
        "flex_folded": flex_folded,
    }


def profile_top(fn, device, rows: int = 6) -> str:
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(5):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--lengths", nargs="+", type=int, default=[8192, 32768])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--profile", action="store_true", help="print the top kernels of lib_sdpa and lib_flex")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("probe_gpu_decode: no CUDA device", file=sys.stderr)
        return 3
    device = torch.device(args.device)
    dtype = torch.bfloat16
    doc = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
           "reps": args.reps, "cells": []}
    gen = torch.Generator().manual_seed(0)
    for geo, (Hkv, G, D) in GEOMETRIES.items():
        for N in args.lengths:
            q = torch.randn(1, Hkv * G, 1, D, generator=gen).to(device, dtype)
            k = torch.randn(1, Hkv, N, D, generator=gen).to(device, dtype)
            v = torch.randn(1, Hkv, N, D, generator=gen).to(device, dtype)
            ls = torch.log(torch.randint(1, 5, (1, Hkv, N), generator=gen).float()).to(device)
            scale = 1.0 / math.sqrt(D)
            kr = k.double().repeat_interleave(G, 1)
            s = (q.double() @ kr.transpose(-1, -2)) * scale + ls.double().repeat_interleave(G, 1)[:, :, None]
            ref = s.softmax(-1) @ v.double().repeat_interleave(G, 1)
            cell = {"geometry": geo, "N": N, "ms": {}, "max_err": {}, "errors": {}}
            for name, fn in variants(q, k, v, ls, scale).items():
                try:
                    out = fn()
                    cell["max_err"][name] = float((out.double() - ref).abs().max()) if name != "stock" else None
                    cell["ms"][name] = timed(fn, device, args.reps)
                except Exception as exc:  # noqa: BLE001 - a variant the platform lacks is recorded
                    cell["errors"][name] = f"{type(exc).__name__}: {str(exc)[:300]}"
            print(geo, N, {k_: round(v_, 4) for k_, v_ in cell["ms"].items()}, cell["errors"] or "", flush=True)
            if args.profile and N == max(args.lengths):
                fns = variants(q, k, v, ls, scale)
                for name in ("lib_sdpa", "lib_flex"):
                    try:
                        cell.setdefault("profile", {})[name] = profile_top(fns[name], device)
                        print(name, "\n", cell["profile"][name], flush=True)
                    except Exception as exc:  # noqa: BLE001
                        print(name, "profile failed", exc, flush=True)
            doc["cells"].append(cell)
    if args.out is not None:
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
