"""Timing: greedy decode steps through the whole model, and decode attention alone.

TPOT is measured by stepping several caches in turn (round robin, one token each), so load
changes on a shared machine hit every method alike; each cache first runs its warm-up steps
alone (FlexAttention compiles there).
"""

from __future__ import annotations

import math
import statistics
import time

import torch
import torch.nn.functional as F
from torch import Tensor

from ..hf import Backends, compile_count


class DecodeStream:
    """Greedy decoding of one cache: ``step()`` feeds the current token and returns seconds.

    first_token: [1, 1] long, the last context token (the cache holds the ones before it)
    """

    def __init__(self, model, cache, first_token: Tensor, cache_key: str):
        self.model, self.cache, self.key = model, cache, cache_key
        self.token = first_token
        self.times: list[float] = []
        self.compiles = 0  # flex graphs compiled during this stream's steps

    def step(self) -> float:
        before = compile_count()
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model(input_ids=self.token, use_cache=True, **{self.key: self.cache})
            self.token = out.logits[:, -1:].argmax(-1)
        seconds = time.perf_counter() - start
        self.compiles += compile_count() - before
        return seconds

    def decode_compressions(self) -> int:
        stats = getattr(self.cache, "stats", None)
        return 0 if stats is None else int(stats.get("decode_compressions", 0))


def summarize(seconds: list[float]) -> dict:
    """Median / mean / min / max in ms, and the raw per-step ms."""
    if not seconds:
        return {"median_ms": None, "mean_ms": None, "min_ms": None, "max_ms": None, "steps_ms": []}
    ms = [s * 1e3 for s in seconds]
    return {"median_ms": round(statistics.median(ms), 3), "mean_ms": round(statistics.fmean(ms), 3),
            "min_ms": round(min(ms), 3), "max_ms": round(max(ms), 3), "steps_ms": [round(x, 2) for x in ms]}


def round_robin(streams: list[DecodeStream], steps: int, bar=None) -> list:
    """``steps`` tokens per stream, one stream after another for each token (a round); returns
    the 1-minute load average after each round."""
    from .machine import load_average

    loads = []
    for _ in range(steps):
        for s in streams:
            s.times.append(s.step())
        loads.append((load_average() or [None])[0])
        if bar is not None:
            bar.update(1)
    return loads


# ---------------------------------------------------------------------------- attention alone
def layer_tensors(cache) -> list[tuple[Tensor, Tensor, Tensor | None]]:
    """(keys [B, H_kv, N, D], values, log_sizes [B, H_kv, N] or None) per layer, as a decode step
    reads them (padding slots of shorter heads included)."""
    out = []
    for layer in cache.layers:
        out.append((layer.keys, layer.values, getattr(layer, "log_sizes", None)))
    return out


def attention_time(layers, num_q_heads: int, backend: str, *, reps: int = 5, seed: int = 0) -> dict:
    """Seconds of one decode step's attention (L = 1) over every layer, best and median of
    ``reps`` after one warm-up (which compiles flex on first use).

    backend: "stock" (F.scaled_dot_product_attention with enable_gqa, no log-sizes: what a plain
             cache costs), "sdpa" or "flex" (kvcompress proportional attention)
    """
    gen = torch.Generator().manual_seed(seed)
    calls = []
    for keys, values, ls in layers:
        B, H, N, D = keys.shape
        q = torch.randn(B, num_q_heads, 1, D, generator=gen).to(keys.dtype)
        scale = 1.0 / math.sqrt(D)
        if backend == "stock":
            calls.append(lambda q=q, k=keys, v=values, s=scale: F.scaled_dot_product_attention(
                q, k, v, scale=s, enable_gqa=True))
        else:
            fn = Backends(backend)
            if ls is None:
                ls = torch.zeros(B, H, N, dtype=torch.float32, device=keys.device)
            calls.append(lambda q=q, k=keys, v=values, ls=ls, s=scale, fn=fn: fn(
                q, k, v, ls, scale=s, causal=False, use_sizes=True))
    before = compile_count()
    times = []
    with torch.inference_mode():
        for rep in range(reps + 1):
            start = time.perf_counter()
            for call in calls:
                call()
            if rep > 0:
                times.append(time.perf_counter() - start)
    ms = [t * 1e3 for t in times]
    return {"median_ms": round(statistics.median(ms), 4), "min_ms": round(min(ms), 4), "reps": reps,
            "compiles": compile_count() - before}


class plain_attention:
    """``with plain_attention(model):`` the model runs transformers' own SDPA attention (no
    kvcompress code in the path) and gets its previous implementation back afterwards."""

    def __init__(self, model, implementation: str = "sdpa"):
        self.model, self.implementation = model, implementation
        self.previous = None

    def __enter__(self):
        self.previous = self.model.config._attn_implementation
        self.model.set_attn_implementation(self.implementation)
        return self.model

    def __exit__(self, *exc):
        self.model.set_attn_implementation(self.previous)
