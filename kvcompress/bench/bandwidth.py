"""The machine's memory-bandwidth floor, measured: how fast one process streams bytes it has to
read once (a decode step reads every weight and the whole cache once).

Two ways of reading ``size`` bytes are timed, best of ``reps`` after a warm-up, with the torch
threads the benchmark uses:

- ``sum``:  a float32 reduction over the buffer (the plainest streaming read);
- ``gemv``: a matrix-vector product over the buffer viewed as a [rows, 4096] matrix (what a
            decode step does with its weights).

The floor bandwidth is the faster of the two: no decode step can read its bytes faster than
the machine streamed them here. Buffers are far larger than any last-level cache.
"""

from __future__ import annotations

import time

import torch

from ..validation import check_int

DEFAULT_BYTES = 512 * 1024 * 1024
GEMV_COLS = 4096


def measure_bandwidth(size: int = DEFAULT_BYTES, reps: int = 5) -> dict:
    """{"sum_gbps", "gemv_gbps", "gbps" (the max), "bytes", "reps", "threads"}; GB = 1e9 bytes."""
    check_int("size", size, GEMV_COLS * 4)
    check_int("reps", reps, 1)
    rows = size // (4 * GEMV_COLS)
    buf = torch.empty(rows, GEMV_COLS, dtype=torch.float32)
    buf.uniform_(-1.0, 1.0)  # touch every page before timing
    vec = torch.ones(GEMV_COLS, dtype=torch.float32)
    nbytes = buf.numel() * buf.element_size()
    out = {"bytes": nbytes, "reps": reps, "threads": torch.get_num_threads()}
    with torch.inference_mode():
        for name, fn in (("sum", lambda: buf.sum()), ("gemv", lambda: torch.mv(buf, vec))):
            fn()
            best = float("inf")
            for _ in range(reps):
                start = time.perf_counter()
                fn()
                best = min(best, time.perf_counter() - start)
            out[f"{name}_gbps"] = round(nbytes / best / 1e9, 3)
    out["gbps"] = max(out["sum_gbps"], out["gemv_gbps"])
    del buf
    return out


def floor_ms(bytes_read: int, gbps: float) -> float:
    """Milliseconds to stream ``bytes_read`` bytes at ``gbps`` GB/s."""
    return bytes_read / (gbps * 1e9) * 1e3
