"""A/B of the compression code: the strategy modules at a git ref (default ``main``) against the
working tree, in one process, on one SmolLM2 8k snapshot, interleaved, CPU time.

    python benchmarks/bench_cost_ab.py --base main \
        --modules kvcompress.strategies.gsc kvcompress.strategies.csm kvcompress.strategies.d2o \
                  kvcompress.strategies.sentences \
        --presets semanticache kvzip-gsc d2o --reps 3 --out benchmarks/results/cost_ab_smollm2_8192.json

The old module's source (``git show REF:path``) is executed as a separate module; for each A run
its functions and numeric constants replace the live module's (and the same names imported into
other kvcompress modules), its classes' methods replace the live classes' methods; for each B run
the live ones are put back. Orders alternate per repetition (old-new, new-old, ...). The outputs of
the last A and B runs of every preset are compared: ``identical`` means keys, values, log-sizes
and positions equal bit for bit in every layer.

The snapshot (every layer's keys, values and last 64 queries after an 8k prefill of the Paul Graham
essays) is recorded once and saved to ``--snapshot``; later runs load it.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the working tree's kvcompress (B), not an installed one of another checkout


def old_module(name: str, ref: str) -> types.ModuleType:
    path = name.replace(".", "/") + ".py"
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{ref}:{path}"], capture_output=True, text=True,
                         check=True).stdout
    mod = types.ModuleType(name + "_old")
    mod.__package__ = name.rsplit(".", 1)[0]
    sys.modules[mod.__name__] = mod
    import kvcompress.registry as reg

    saved = {k: getattr(reg, k) for k in dir(reg) if k.startswith("register_")}
    for k in saved:  # the old classes must not replace the registered ones
        setattr(reg, k, lambda *a, **kw: (lambda c: c))
    try:
        exec(compile(src, f"<{ref}:{path}>", "exec"), mod.__dict__)
    finally:
        for k, v in saved.items():
            setattr(reg, k, v)
    return mod


def swaps_for(name: str, ref: str) -> list:
    """(object, attribute, new value, old value) for every function, constant and method the old
    module defines that the live one has too."""
    live = importlib.import_module(name)
    old = old_module(name, ref)
    out = []
    for k, v in old.__dict__.items():
        if k.startswith("__") or k not in live.__dict__:
            continue
        cur = live.__dict__[k]
        if isinstance(v, type) and isinstance(cur, type) and v.__module__ == old.__name__:
            for a, f in v.__dict__.items():
                if isinstance(f, (types.FunctionType, staticmethod, classmethod, property)) and a in cur.__dict__:
                    out.append((cur, a, cur.__dict__[a], f))
        elif (isinstance(v, types.FunctionType) and v.__module__ == old.__name__) or (
                isinstance(v, (int, float)) and not isinstance(v, bool)):
            out.append((live, k, cur, v))
            for mname, mod in list(sys.modules.items()):
                if mod is not None and mname.startswith("kvcompress") and mod is not live and \
                        getattr(mod, k, None) is cur:
                    out.append((mod, k, cur, v))
    return out


def use(swaps, which: str) -> None:
    for obj, attr, new, old in swaps:
        setattr(obj, attr, old if which == "old" else new)


def snapshot(path: Path, length: int):
    if path.exists():
        return torch.load(path, weights_only=False)["states"]
    from kvcompress.bench.caches import prefill_snapshot
    from kvcompress.bench.sources import TokenSource, load
    from kvcompress.presets import get_preset

    cfgs = [get_preset(n, keep_ratio=0.25, on_infeasible="best_effort").replace(track_attention=False)
            for n in ("snapkv", "semanticache-safe")]  # 64 queries recorded
    loaded = load("smollm2")
    ids = TokenSource(loaded.tokenizer, loaded.vocab).ids(length)
    snap, _ = prefill_snapshot(loaded.model, loaded.tokenizer, loaded.vocab, ids, cfgs)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"states": snap.states}, path)
    return snap.states


def run(cfg, states):
    from kvcompress import Pipeline

    with torch.inference_mode():
        pipe = Pipeline(cfg)
        start = time.process_time()
        if pipe.needs_all_layers:
            pipe.prepare(states)
        outs = [pipe.compress(st, i)[0] for i, st in enumerate(states)]
        return time.process_time() - start, outs


def same(a, b) -> bool:
    return all(x.keys.shape == y.keys.shape and torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values)
               and torch.equal(x.log_sizes, y.log_sizes) and torch.equal(x.positions, y.positions)
               for x, y in zip(a, b))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="main")
    ap.add_argument("--modules", nargs="+", required=True)
    ap.add_argument("--presets", nargs="+", required=True)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--snapshot", type=Path, default=Path("/tmp/kvcompress_snapshot_8192.pt"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.reps < 1:
        ap.error("--reps >= 1")
    from kvcompress.presets import get_preset, list_presets

    unknown = [p for p in args.presets if p not in list_presets()]
    if unknown:
        ap.error(f"unknown presets {unknown}")
    torch.set_num_threads(args.threads)
    from kvcompress.bench import cost
    from kvcompress.bench.machine import describe_machine, load_average

    swaps = [s for m in args.modules for s in swaps_for(m, args.base)]
    states = snapshot(args.snapshot, args.length)
    doc = {"benchmark": f"compression CPU seconds, {args.base} vs the working tree, one process, interleaved",
           "command": " ".join(sys.argv), "machine": describe_machine(), "modules": args.modules,
           "base": args.base, "head": subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"],
                                                    capture_output=True, text=True).stdout.strip(),
           "layers": len(states), "reps": args.reps, "presets": {}}
    for name in args.presets:
        cfg = get_preset(name, keep_ratio=0.25, on_infeasible="best_effort")
        sts = cost.with_inputs(states, cfg)
        for which in ("old", "new"):  # warm-up
            use(swaps, which)
            run(cfg, sts[:2])
        secs = {"old": [], "new": []}
        outs = {}
        load_start = load_average()
        for r in range(args.reps):
            for which in (("old", "new") if r % 2 == 0 else ("new", "old")):
                use(swaps, which)
                t, outs[which] = run(cfg, sts)
                secs[which].append(t)
        use(swaps, "new")
        rec = {"old_cpu_s": secs["old"], "new_cpu_s": secs["new"], "new_over_old_min": min(secs["new"]) / min(secs["old"]),
               "new_over_old_median": statistics.median(secs["new"]) / statistics.median(secs["old"]),
               "identical": same(outs["old"], outs["new"]), "load_average_start": load_start,
               "load_average_end": load_average()}
        doc["presets"][name] = rec
        print(f"{name:24s} old min {min(secs['old']):.3f} s  new min {min(secs['new']):.3f} s  "
              f"new/old {rec['new_over_old_min']:.3f} (median {rec['new_over_old_median']:.3f})  identical {rec['identical']}",
              flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
