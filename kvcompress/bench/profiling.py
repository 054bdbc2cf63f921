"""Where the time goes: torch.profiler over decode steps, cProfile + torch.profiler over one
layer's compression. Summaries are plain dicts for the results file."""

from __future__ import annotations

import cProfile
import os
import pstats
import time

import torch
from torch.profiler import ProfilerActivity, profile


def _ops(prof, divide: int, top: int) -> tuple[list[dict], float]:
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total_us = sum(e.self_cpu_time_total for e in events)
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    rows = [{"op": e.key, "self_ms": round(e.self_cpu_time_total / 1e3 / divide, 3),
             "calls": round(e.count / divide, 1), "share": round(e.self_cpu_time_total / max(total_us, 1), 4)}
            for e in events[:top]]
    return rows, total_us / 1e3 / divide


def profile_decode(stream, steps: int = 2, top: int = 12) -> dict:
    """Top torch ops (self CPU time per decode step) of ``steps`` steps of a DecodeStream."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            stream.step()
        wall = (time.perf_counter() - start) / steps
    rows, op_ms = _ops(prof, steps, top)
    return {"wall_ms_per_step": round(wall * 1e3, 2), "op_ms_per_step": round(op_ms, 2),
            "python_and_other_ms": round(max(wall * 1e3 - op_ms, 0.0), 2), "top_ops": rows}


def profile_compression(config, state, layer_idx: int = 0, top: int = 12) -> dict:
    """One layer's ``Pipeline.compress``: its kvcompress functions by cumulative time (cProfile)
    and its torch ops by self time (torch.profiler, a second run)."""
    from ..pipeline import Pipeline

    pipe = Pipeline(config)
    with torch.inference_mode():
        pipe.compress(state, layer_idx)  # warm-up: first-call costs are not the method's
        prof = cProfile.Profile()
        start = time.perf_counter()
        prof.enable()
        pipe.compress(state, layer_idx)
        prof.disable()
        wall = time.perf_counter() - start
        with profile(activities=[ProfilerActivity.CPU]) as tprof:
            pipe.compress(state, layer_idx)
    stats = pstats.Stats(prof)
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    funcs = []
    for (path, line, name), (cc, nc, tt, ct, _) in stats.stats.items():
        if os.path.abspath(path).startswith(package):
            funcs.append({"function": f"{os.path.relpath(path, os.path.dirname(package))}:{line}({name})",
                          "calls": nc, "cum_ms": round(ct * 1e3, 2), "self_ms": round(tt * 1e3, 2)})
    funcs.sort(key=lambda f: f["cum_ms"], reverse=True)
    ops, op_ms = _ops(tprof, 1, top)
    return {"layer": layer_idx, "wall_ms": round(wall * 1e3, 2), "op_ms": round(op_ms, 2),
            "functions": funcs[:top], "top_ops": ops, "slots_in": int(state.num_slots),
            "torch_calls": int(sum(e.count for e in tprof.key_averages()))}
