"""Compose a compression pipeline from a plain Python dict and compress one layer's cache.

    python examples/pipeline_from_dict.py                 # 512 tokens, keep 25%
    python examples/pipeline_from_dict.py --tokens 2048 --keep-ratio 0.5

No model needed: the cache is synthetic (examples/toy_cache.py: sentences over a toy vocabulary,
keys that follow the sentences). With a real model the keys and values come from its cache
(``cache.layers[i].keys`` / ``.values``, [B, H_kv, N, D]) and the vocabulary from its tokenizer.
"""

from __future__ import annotations

import argparse

import torch

import kvcompress
from toy_cache import toy_cache, toy_queries

# SemantiCache written out in full: every field that is left out takes its default
# (docs/config.md lists them all).
CONFIG = {
    "name": "my-semanticache",
    "keep_ratio": 0.25,                  # keep a quarter of the tokens (per batch row, every head)
    "sinks": 4,                          # first tokens, never merged
    "recent": 32,                        # last tokens, never merged
    "chunker": {"name": "delimiter",     # split at delimiter tokens; delimiters become anchors
                "params": {"delimiters": [".", ",", "?", "!", "\n"]}},
    "clusterer": {"name": "gsc",         # greedy seed clustering, tau searched per head
                  "params": {"search_width": 15, "search_passes": 3}},
    "merger": {"name": "mean"},          # size-weighted mean of keys and values; sizes add up
}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--keep-ratio", type=float, default=CONFIG["keep_ratio"])
    args = parser.parse_args(argv)

    keys, values, token_ids, vocab = toy_cache(args.tokens, heads=args.heads)
    state = kvcompress.KVState.from_raw(keys, values, token_ids=token_ids, vocab=vocab)

    pipe = kvcompress.Pipeline(CONFIG, keep_ratio=args.keep_ratio)  # keyword overrides win over the dict
    compressed, report = pipe.compress(state, layer_idx=0)
    print(f"pipeline: {pipe.config.name}  chunker={pipe.config.chunker.name} "
          f"clusterer={pipe.config.clusterer.name} merger={pipe.config.merger.name}")
    print(f"{state.num_tokens} tokens -> slots per head {report.slots_per_head.tolist()} "
          f"(target {report.target.tolist()}, budget met: {report.budget_met}, tau per head "
          f"{[[round(t, 3) for t in row] for row in report.tau.tolist()]})")
    sizes = compressed.sizes()[compressed.valid]
    print(f"largest slot stands for {int(sizes.max())} tokens; sizes add up to {int(sizes.sum())} "
          f"= {args.heads} heads x {state.num_tokens} tokens")

    # Proportional attention over the merged cache (log(size) added to the logits) equals plain
    # attention over the "expanded" cache where every slot is repeated size times.
    q = toy_queries(keys, num_queries=4)
    merged_out = kvcompress.proportional_attention(q, compressed.keys, compressed.values,
                                                   compressed.log_sizes, causal=False)
    ek, ev, els = kvcompress.expand_state(compressed)
    expanded_out = kvcompress.proportional_attention(q, ek, ev, els, causal=False)
    gap = float((merged_out - expanded_out).abs().max())
    print(f"merged vs expanded attention output: max |diff| = {gap:.2e}")
    assert gap < 1e-5

    # The config is plain data: it round-trips through JSON.
    cfg = pipe.config
    assert kvcompress.PipelineConfig.from_json(cfg.to_json()) == cfg
    return {"slots_per_head": report.slots_per_head.tolist(), "budget_met": report.budget_met,
            "max_attention_gap": gap}


if __name__ == "__main__":
    torch.set_num_threads(min(4, torch.get_num_threads()))
    main()
