"""Scratch tensors reused across calls: layers, rounds, buckets.

On CPU a fresh multi-MB tensor is fresh pages from the OS: their page faults (and the kernel's
zeroing) cost about as much as the arithmetic of the memory-bound ops that fill them, once per
op per layer. Intermediates that never leave a call (similarity blocks, bitset words, gathered
rows) take a pooled buffer instead: one per name, grown to the largest size asked, per thread (two
threads compressing at once never share one), separately inside and outside inference mode (an
inference tensor cannot be written outside it). Only CPU tensors of ``POOL_MIN`` to ``POOL_LIMIT`` bytes
are pooled, and a thread's pool holds at most ``POOL_TOTAL`` bytes (SmolLM2 at 8k: 62 MB for GSC, CSM
and the merges together); anything else is a plain ``torch.empty`` (CUDA has its caching
allocator). ``clear()`` hands the memory back, and ``with compression_round():`` around a round of
layers (the transformers cache's scheduler, the vLLM compaction, the cost bench) hands it back when
the round ends, an error included: the reuse spans the layers of one round and nothing stays held
after it. Code driving ``Pipeline`` itself does the same.

The content of a buffer is valid until the next ``scratch`` call with the same name: a caller
must be done with it (or have copied what it keeps) before asking again.
"""

from __future__ import annotations

import math
import threading
from contextlib import contextmanager

import torch
from torch import Tensor

POOL_MIN = 128 << 10  # bytes: smaller ones come from the heap without fresh pages (glibc's mmap threshold)
POOL_LIMIT = 32 << 20  # bytes: larger buffers are not kept (a long prompt's blocks would stay resident)
POOL_TOTAL = 128 << 20  # bytes a thread's pool may hold

_LOCAL = threading.local()


def scratch(name: str, shape: tuple, dtype: torch.dtype, device) -> Tensor:
    """An uninitialised contiguous tensor of ``shape``, the pooled one for ``name`` when it fits."""
    numel = math.prod(shape)
    size = numel * dtype.itemsize
    if not POOL_MIN <= size <= POOL_LIMIT or torch.device(device).type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    pool = getattr(_LOCAL, "pool", None)
    if pool is None:
        pool = _LOCAL.pool = {}
    key = (name, dtype, torch.is_inference_mode_enabled())
    buf = pool.get(key)
    if buf is None or buf.numel() < numel:
        held = sum(b.numel() * b.element_size() for k, b in pool.items() if k != key)
        if held + size > POOL_TOTAL:
            return torch.empty(shape, dtype=dtype, device=device)
        buf = pool[key] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel].view(shape)


def pooled_bytes() -> int:
    """Bytes this thread's pool holds."""
    return sum(b.numel() * b.element_size() for b in getattr(_LOCAL, "pool", {}).values())


def clear() -> None:
    """Drop this thread's pooled buffers (tests; a process done compressing)."""
    _LOCAL.pool = {}


@contextmanager
def compression_round():
    """The pool is this thread's for the block's layers and handed back when it ends (or raises)."""
    try:
        yield
    finally:
        clear()
