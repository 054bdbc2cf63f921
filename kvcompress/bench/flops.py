"""FLOP lower bounds of the presets whose algorithm compares all pairs, against the prefill.

D2O (``d2o``, ``kvzip-d2o*``) finds, for every evicted slot, its most similar kept slot: an
E x K product of key vectors per head (E evicted, K kept). SemantiCache over a whole head
(``semanticache-global``) compares each seed with every later slot of the head: the N (N - 1) / 2
cosines of a head, at the least. Neither can cost less than these products, so their share of the
prefill is bounded below by

    product FLOPs / prefill FLOPs   (at equal FLOP rates), and, measured,
    product seconds / prefill seconds   (the product alone, timed as the method computes it).

``prefill_flops`` counts the matmul FLOPs of a causal prefill from a transformers config:
2 x (non-embedding weights) per token for the linear layers, and 2 x 2 x N^2 / 2 x head_dim per
query head and layer for the attention scores and their weighted sum (causal: half the square).
Norms, activations, softmax and rotary embeddings are left out (a lower bound of the prefill).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F


def prefill_flops(config, num_tokens: int) -> dict:
    """{"linear", "attention", "total"} matmul FLOPs of a causal prefill of ``num_tokens``.

    config: a transformers Llama-style config (hidden_size, intermediate_size, num_hidden_layers,
            num_attention_heads, num_key_value_heads, head_dim or hidden_size / heads)
    """
    h, m, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    per_layer = h * heads * head_dim + 2 * h * kv_heads * head_dim + heads * head_dim * h + 3 * h * m
    linear = 2 * per_layer * layers * num_tokens
    attention = 2 * 2 * (num_tokens * num_tokens / 2) * head_dim * heads * layers
    return {"linear": float(linear), "attention": float(attention), "total": float(linear + attention)}


def d2o_product(num_tokens: int, keep_ratio: float, *, heads: int, head_dim: int, layers: int,
                reps: int = 3, seed: int = 0, coarse: bool | None = None) -> dict:
    """The D2O evicted x kept cosine product of every layer, timed as ``most_similar_kept`` computes it
    (the same blocks into one reused buffer) but with nothing else: no row maximum, no gathers.

    coarse: time the bfloat16 product of its coarse search (None: where ``d2o.coarse_available``),
            else the float32 one.
    K = round(keep_ratio * N) kept slots, E = N - K evicted, per head. Returns FLOPs, the fastest
    of ``reps`` timings (seconds for all layers; each rep times one layer x layers), GFLOP/s and the dtype.
    """
    from ..strategies import d2o

    K = max(1, round(keep_ratio * num_tokens))
    E = num_tokens - K
    if coarse is None:
        coarse = d2o.coarse_default(head_dim, heads * E * K, torch.device("cpu"))
    dtype = torch.bfloat16 if coarse else torch.float32
    gen = torch.Generator().manual_seed(seed)
    kept = F.normalize(torch.randn(1, heads, K, head_dim, generator=gen), dim=-1).transpose(-1, -2).to(dtype)
    evicted = F.normalize(torch.randn(1, heads, E, head_dim, generator=gen), dim=-1).to(dtype)
    step = d2o.block_rows(E, heads * K, coarse)
    buf = torch.empty(1, heads, step, K, dtype=dtype)
    best = float("inf")
    with torch.inference_mode():
        for _ in range(reps):
            start = time.process_time()
            for n0 in range(0, E, step):
                b = min(step, E - n0)
                torch.matmul(evicted[:, :, n0:n0 + b], kept,
                             out=buf if b == step else torch.empty(1, heads, b, K, dtype=dtype))
            best = min(best, time.process_time() - start)
    flops = 2.0 * E * K * head_dim * heads * layers
    return {"evicted": E, "kept": K, "flops": flops, "cpu_s": best * layers, "gflops_per_s": flops / layers / best / 1e9,
            "dtype": str(dtype).removeprefix("torch.")}


def all_pairs_product(num_tokens: int, *, heads: int, head_dim: int, layers: int, reps: int = 1,
                      seed: int = 0, block: int = 1024) -> dict:
    """The cosines of all slot pairs of every head (the least a whole-head GSC computes), timed
    by row blocks of the upper triangle (block rows x the slots from the block on), one layer
    timed and scaled by ``layers``. FLOPs counted for N (N - 1) / 2 pairs per head."""
    gen = torch.Generator().manual_seed(seed)
    keys = F.normalize(torch.randn(1, heads, num_tokens, head_dim, generator=gen), dim=-1)
    best = float("inf")
    with torch.inference_mode():
        for _ in range(reps):
            start = time.process_time()
            for n0 in range(0, num_tokens, block):
                torch.matmul(keys[:, :, n0:n0 + block], keys[:, :, n0:].transpose(-1, -2))
            best = min(best, time.process_time() - start)
    pairs = num_tokens * (num_tokens - 1) / 2
    flops = 2.0 * pairs * head_dim * heads * layers
    return {"pairs_per_head": pairs, "flops": flops, "cpu_s": best * layers,
            "gflops_per_s": flops / layers / best / 1e9}
