"""Load a pipeline from a JSON file, override a few fields, and compress a multi-layer cache.

    python examples/pipeline_from_json.py                                  # examples/pipeline.json
    python examples/pipeline_from_json.py --config my.json --set keep_ratio=0.5 --set clusterer.r_init=0.3

A JSON config is the dict form of a PipelineConfig (docs/config.md); ``--set FIELD=VALUE`` applies
the same overrides Python code passes as keywords (``Pipeline(path, keep_ratio=0.5)``), strategy
parameters as ``stage.param``. No model needed: the cache is synthetic (examples/toy_cache.py).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import kvcompress
from toy_cache import toy_cache

HERE = Path(__file__).resolve().parent


def parse_set(items: list[str]) -> dict:
    overrides = {}
    for item in items:
        key, _, raw = item.partition("=")
        try:
            overrides[key] = json.loads(raw)
        except json.JSONDecodeError:
            overrides[key] = raw  # a bare string, e.g. --set chunker=global
    return overrides


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=HERE / "pipeline.json")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--save", type=Path, default=None, help="write the effective config as JSON here")
    args = parser.parse_args(argv)

    config = kvcompress.as_config(str(args.config), **parse_set(args.set))  # file + overrides
    pipe = kvcompress.Pipeline(config)
    print(f"config {args.config.name} -> {config.name}: keep_ratio={config.keep_ratio}, "
          f"chunker={config.chunker.to_dict()}, clusterer={config.clusterer.to_dict()}")

    total_tokens = total_slots = 0
    for layer in range(args.layers):  # one cache per layer, as a model would have
        keys, values, ids, vocab = toy_cache(args.tokens, heads=3, head_dim=64, batch=args.batch, seed=layer)
        state = kvcompress.KVState.from_raw(keys, values, token_ids=ids, vocab=vocab)
        compressed, report = pipe.compress(state, layer_idx=layer)
        total_tokens += state.num_tokens * state.batch_size * state.num_heads
        total_slots += int(report.slots_per_head.sum())
        print(f"layer {layer}: {state.num_slots} -> {compressed.num_slots} slots "
              f"(padding {report.padding_slots}, rounds {report.rounds}, budget met: {report.budget_met}, "
              f"bytes {state.bytes()} -> {compressed.bytes()})")
    print(f"kept {total_slots} of {total_tokens} token slots ({total_slots / total_tokens:.3f})")

    if args.save is not None:
        args.save.write_text(config.to_json())
        assert kvcompress.PipelineConfig.from_json(args.save) == config  # a path works as well as text
        print(f"wrote {args.save}")
    return {"kept": total_slots, "tokens": total_tokens, "config": config.to_dict()}


if __name__ == "__main__":
    torch.set_num_threads(min(4, torch.get_num_threads()))
    main()
