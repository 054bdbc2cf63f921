"""A/B of SemantiCache's decode path on SmolLM2 (issue 7): what the budget-floor check costs per
decode step, before and after the two fixes.

SemantiCache at keep 0.25 / 0.2 cannot reach its target (delimiter anchors and one slot per chunk
make ~28 % of the tokens), so every decode step asks ``DecodeCompressor.should_compress`` for the
floor. Four caches decode from one prefill, stepped round robin (load changes hit all alike):

- uncompressed:                 kvcompress's cache without a pipeline
- semanticache, neither fix:    the floor recomputed at every step (protection + the delimiter
                                chunker over the whole cache) and the delimiter table looked up by
                                hashing the 49k-string vocabulary tuple (the code before the fix)
- semanticache, table fix only: the floor recomputed at every step, the table keyed by identity
- semanticache, both fixes:     the library as it is (floor memo + identity-keyed table)

    python benchmarks/bench_decode_floor.py [--length 8192] [--budget 0.25] [--steps 12] [--threads 1]

Results: benchmarks/results/decode_floor.json (with the machine and the load averages).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from functools import lru_cache
from pathlib import Path

import torch

import kvcompress.strategies.chunkers as chunkers
from kvcompress.bench import caches as C
from kvcompress.bench.machine import describe_machine, load_average
from kvcompress.bench.sources import TokenSource, load
from kvcompress.bench.timing import DecodeStream, summarize
from kvcompress.decode import DecodeCompressor
from kvcompress.hf.generate import cache_kwarg
from kvcompress.presets import get_preset

RESULTS = Path(__file__).parent / "results"


@lru_cache(maxsize=16)
def hashed_table(vocab: tuple[str, ...], delimiters: tuple[str, ...]) -> torch.Tensor:
    """The delimiter table as it was looked up before: an lru_cache keyed by the whole vocabulary."""
    return torch.tensor([any(d in text for d in delimiters) for text in vocab], dtype=torch.bool)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--budget", type=float, default=0.25)
    ap.add_argument("--steps", type=int, default=12, help="timed decode steps per cache (after 2 warm-up steps)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=RESULTS / "decode_floor.json")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    machine = describe_machine()
    identity_table = chunkers._delimiter_table

    loaded = load("smollm2")
    ids = TokenSource(loaded.tokenizer, loaded.vocab, None, 0).ids(args.length + 1)
    cfg = get_preset("semanticache", keep_ratio=args.budget, on_infeasible="best_effort")
    snap, prefill_s = C.prefill_snapshot(loaded.model, loaded.tokenizer, loaded.vocab, ids[:, :args.length], [cfg])
    model, key = loaded.model, cache_kwarg(loaded.model)
    fixed = C.compressed_cache(model, snap, cfg, "sdpa").cache
    caches = {"uncompressed": (C.uncompressed_cache(model, snap, "sdpa"), identity_table),
              "semanticache, both fixes": (fixed, identity_table)}
    for name, table in (("semanticache, table fix only", identity_table),
                        ("semanticache, neither fix", hashed_table)):
        twin = C.clone_cache(fixed, model)
        twin.decoder = DecodeCompressor(twin.pipeline)
        twin.decoder._floors = None  # no floor memo: the floor is recomputed at every step
        caches[name] = (twin, table)
    streams = {name: (DecodeStream(model, cache, ids[:, args.length:], key), table)
               for name, (cache, table) in caches.items()}

    def step_all():
        for stream, table in streams.values():
            chunkers._delimiter_table = table  # delimiter_mask looks the name up at call time
            stream.times.append(stream.step())
        chunkers._delimiter_table = identity_table

    load_start = load_average()
    for _ in range(2):
        step_all()
    for stream, _ in streams.values():
        stream.times.clear()
    for _ in range(args.steps):
        step_all()
    result = {
        "benchmark": "bench_decode_floor", "machine": machine,
        "command": " ".join(["python"] + sys.argv),
        "settings": {"model": "smollm2", "length": args.length, "budget": args.budget, "steps": args.steps,
                     "threads": args.threads},
        "prefill_s": round(prefill_s, 2), "load_average_start": load_start, "load_average_end": load_average(),
        "slots_per_layer_head": int(fixed.layers[0].valid_slots().float().mean()),
        "tpot": {name: summarize(stream.times) for name, (stream, _) in streams.items()},
    }
    for name, t in result["tpot"].items():
        print(f"{name:32s} median {t['median_ms']:.1f} ms per token")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
