"""Ablation: semantic chunks vs fixed 64-token chunks vs no chunks (global), on the same cache.

    python examples/ablation_chunking.py                          # synthetic cache, CPU, seconds
    python examples/ablation_chunking.py --model smollm2          # SmolLM2-135M-Instruct: CPU-minutes
    python examples/ablation_chunking.py --model smollm2 --layers 0,12,24   # fewer layers, faster
    python examples/ablation_chunking.py --model smollm2 --text-file essay.txt --tokens 2048 --json out.json

For every budget and chunking (presets ``semanticache``, ``semanticache-fixed64``,
``semanticache-global``: only the chunker differs) it compresses the context before the last W
tokens of each layer, appends those W tokens uncompressed (as decoding would), and reports

- the slots it achieved per head (semantic chunking cannot go below one slot per chunk plus its
  delimiter anchors, so at low budgets it may stop above the budget: ``on_infeasible="best_effort"``
  reports that instead of raising), and
- the relative error ||out - out_full|| / ||out_full|| of the attention output of the last W
  queries over the compressed cache (proportional attention) against the full cache.

Synthetic mode (default) uses examples/toy_cache.py: sentence-structured keys and queries that
look for earlier stretches of text. Model mode runs the prefill of a real text with a plain
DynamicCache and records each layer's last W queries (after RoPE) with a small attention hook.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import kvcompress
from kvcompress import KVState, Pipeline, proportional_attention

CHUNKINGS = {"semantic": "semanticache", "fixed-64": "semanticache-fixed64", "global": "semanticache-global"}


# ------------------------------------------------------------------------------------ caches
def synthetic_layers(tokens: int, window: int, layers: int, heads: int = 2, head_dim: int = 64):
    """Per layer: keys, values [1, H, T, D], queries [1, H, W, D], token ids [1, T], vocab."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from toy_cache import toy_cache, toy_queries

    out = []
    for layer in range(layers):
        keys, values, ids, vocab = toy_cache(tokens, heads=heads, head_dim=head_dim, seed=layer)
        queries = toy_queries(keys, window, seed=100 + layer)
        out.append((keys, values, queries, ids, vocab))
    return out


def record_queries(model, input_ids: torch.Tensor, window: int):
    """Prefill with a plain DynamicCache; returns per layer (keys, values [B, H_kv, T, D],
    queries [B, H_q, W, D] of the last W tokens, after RoPE)."""
    from transformers import AttentionInterface, DynamicCache
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    captured = {}

    def recording_attention(module, query, key, value, attention_mask, **kwargs):
        captured[module.layer_idx] = query[:, :, -window:].detach().float()
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    name = "kvcompress_example_record"  # no "sdpa" in the name: transformers special-cases it
    AttentionInterface.register(name, recording_attention)
    AttentionMaskInterface.register(name, sdpa_mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=input_ids, cache=cache, use_cache=True)
    finally:
        model.set_attn_implementation(previous)
    return [(layer.keys.float(), layer.values.float(), captured[i]) for i, layer in enumerate(cache.layers)]


def model_layers(model_name: str, text: str, tokens: int, window: int, layers: list[int] | None):
    from kvcompress.viz import load_model, token_texts, vocab_for

    model, tokenizer = load_model(model_name)
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :tokens]
    texts = token_texts(tokenizer, ids[0].tolist())
    vocab = vocab_for(ids[0].tolist(), texts)
    recorded = record_queries(model, ids, window)
    chosen = range(len(recorded)) if not layers else layers
    return [(*recorded[i], ids, vocab) for i in chosen], list(chosen), ids.shape[1]


def default_text() -> str:
    """Long real English prose that ships with Python: the pydoc topic help texts."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


# ------------------------------------------------------------------------------------ measurement
def attention_error(pipe: Pipeline, keys, values, queries, ids, vocab, layer_idx: int):
    """Compress all but the last W tokens, append them raw, compare the last W queries' outputs.

    returns slots per head [H] (of the compressed context), budget met, relative error per KV head [H]
    """
    B, H, T, D = keys.shape
    W = queries.shape[2]
    ctx = T - W
    prefix = KVState.from_raw(keys[:, :, :ctx], values[:, :, :ctx], token_ids=ids[:, :ctx], vocab=vocab)
    compressed, report = pipe.compress(prefix, layer_idx)
    k = torch.cat([compressed.keys, keys[:, :, ctx:]], dim=2)
    v = torch.cat([compressed.values, values[:, :, ctx:]], dim=2)
    ls = torch.cat([compressed.log_sizes, torch.zeros(B, H, W)], dim=2)
    approx = proportional_attention(queries, k, v, ls, causal=True)  # query i sees the tail up to itself
    full = proportional_attention(queries, keys, values, torch.zeros(B, H, T), causal=True)
    G = queries.shape[1] // H
    diff = (approx - full).reshape(B, H, G * W * D).norm(dim=-1)
    rel = diff / full.reshape(B, H, G * W * D).norm(dim=-1).clamp(min=1e-12)
    return report.slots_per_head[0].float(), report.budget_met, rel[0], ctx


def run(layers, keep_ratios, layer_ids=None) -> list[dict]:
    rows = []
    for ratio in keep_ratios:
        for label, preset in CHUNKINGS.items():
            pipe = Pipeline(preset, keep_ratio=ratio, on_infeasible="best_effort")
            slots, errors, met, t0 = [], [], True, time.perf_counter()
            for i, (keys, values, queries, ids, vocab) in enumerate(layers):
                layer_idx = i if layer_ids is None else layer_ids[i]
                s, ok, rel, ctx = attention_error(pipe, keys, values, queries, ids, vocab, layer_idx)
                slots.append(s)
                errors.append(rel)
                met &= ok
            slots_t, err_t = torch.stack(slots), torch.stack(errors)  # [L, H]
            rows.append({
                "keep_ratio": ratio, "chunking": label, "preset": preset, "context_tokens": ctx,
                "budget_slots": int(ctx * ratio), "slots_mean": round(float(slots_t.mean()), 1),
                "slots_max": int(slots_t.max()), "achieved_keep_ratio": round(float(slots_t.mean()) / ctx, 4),
                "budget_met": met, "attn_rel_error": round(float(err_t.mean()), 5),
                "attn_rel_error_worst_head": round(float(err_t.max()), 5),
                "seconds": round(time.perf_counter() - t0, 2),
            })
    return rows


def print_table(rows: list[dict]) -> None:
    head = f"{'budget':>6} {'chunking':<9} {'target':>6} {'slots':>7} {'achieved':>8} {'met':>5} " \
           f"{'attn err':>9} {'worst':>8}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['keep_ratio']:>6} {r['chunking']:<9} {r['budget_slots']:>6} {r['slots_mean']:>7} "
              f"{r['achieved_keep_ratio']:>8.3f} {str(r['budget_met']):>5} {r['attn_rel_error']:>9.4f} "
              f"{r['attn_rel_error_worst_head']:>8.4f}")


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None,
                        help="'smollm2' or a local model directory (default: a synthetic cache, no model)")
    parser.add_argument("--text-file", type=Path, default=None,
                        help="text for --model (default: Python's pydoc topic texts)")
    parser.add_argument("--tokens", type=int, default=None, help="tokens (default 512 synthetic, 2048 model)")
    parser.add_argument("--window", type=int, default=8, help="last W queries measured (default 8)")
    parser.add_argument("--keep-ratios", default="0.5,0.3", help="comma-separated budgets (default 0.5,0.3)")
    parser.add_argument("--layers", default=None,
                        help="synthetic: number of layers (default 2); model: comma-separated layer indices "
                             "(default all)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    ratios = [float(x) for x in args.keep_ratios.split(",")]

    if args.model is None:
        tokens = args.tokens or 512
        layers = synthetic_layers(tokens, args.window, int(args.layers or 2))
        rows, source = run(layers, ratios), f"synthetic cache, {tokens} tokens, {len(layers)} layers"
    else:
        text = args.text_file.read_text(encoding="utf-8") if args.text_file else default_text()
        chosen = [int(x) for x in args.layers.split(",")] if args.layers else None
        layers, layer_ids, tokens = model_layers(args.model, text, args.tokens or 2048, args.window, chosen)
        rows = run(layers, ratios, layer_ids)
        source = f"{args.model}, {tokens} tokens, layers {layer_ids[0]}..{layer_ids[-1]} ({len(layer_ids)})"
    print(f"chunking ablation on {source}; last {args.window} queries measured")
    print_table(rows)
    if args.json is not None:
        args.json.write_text(json.dumps({"source": source, "window": args.window, "rows": rows,
                                         "torch": torch.__version__, "kvcompress": kvcompress.__version__},
                                        indent=2))
        print(f"wrote {args.json}")
    return rows


if __name__ == "__main__":
    torch.set_num_threads(min(4, torch.get_num_threads()))
    main()
