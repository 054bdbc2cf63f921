"""``kvcompress bench``: decode speed, memory and compression cost, full vs compressed caches.

    kvcompress bench                                   # SmolLM2 2k/4k/8k + synthetic Llama-3-8B 8k-32k
    kvcompress bench --quick                           # a smoke run (minutes)
    kvcompress bench --models smollm2 --lengths 2k,8k --budgets 0.25 --presets semanticache \\
        --backends sdpa,flex --decode-tokens 32 --threads 1
    python -m kvcompress.cli_bench --models llama3-synthetic --synthetic-lengths 32k

Per model and length: one prefill (SmolLM2) or random keys/values (the synthetic Llama-3-8B
stack, whose 32k prefill is too slow on a CPU), then every method decodes from its own copy:
plain transformers (the stock DynamicCache through transformers' own SDPA attention, no kvcompress
code), the uncompressed kvcompress cache, and each preset x budget, on each
attention backend. Writes the results JSON (machine, load average, every run, the floors with
pass/fail, TPOT against plain transformers per round and against the measured bandwidth floor,
profiles) and PNG plots of TPOT and memory against context length.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

COMMAND = "bench"
HELP = "efficiency benchmark: TPOT, prefill/compression time, KV bytes, peak memory, floors"
DEFAULT_OUT = Path("benchmarks/results/efficiency.json")
QUICK = dict(lengths="512", synthetic_lengths="1k", synthetic_layers=1, budgets="0.25", presets=None,
             decode_tokens=3, warmup=1, attention_reps=2, profile=False)


def _ints(text: str) -> tuple[int, ...]:
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        mult = 1024 if part.endswith("k") else 1
        try:
            out.append(int(float(part.rstrip("k")) * mult))
        except ValueError:
            raise ValueError(f"length={part!r} is invalid: expected an integer or NNk (e.g. 2048 or 2k)") from None
    return tuple(out)


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"budgets={text!r} is invalid: expected comma-separated numbers in (0, 1)") from None


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def add_arguments(p: argparse.ArgumentParser) -> None:
    w = p.add_argument_group("what to measure")
    w.add_argument("--models", default="smollm2,llama3-synthetic",
                   help="comma-separated: smollm2, llama3-synthetic, tiny (default: smollm2,llama3-synthetic)")
    w.add_argument("--lengths", default=None, help="context tokens for prefilled models (default 2k,4k,8k)")
    w.add_argument("--synthetic-lengths", default=None,
                   help="context tokens for llama3-synthetic (default 8k,16k,32k)")
    w.add_argument("--synthetic-layers", type=int, default=None, help="Llama-3-8B-shaped layers (default 2)")
    w.add_argument("--budgets", default=None, help="keep ratios (default 0.5,0.25,0.2)")
    w.add_argument("--presets", default=None, help="presets (default semanticache,streamingllm,centroidkv)")
    w.add_argument("--backends", default="sdpa,flex", help="proportional attention backends: sdpa, flex")
    w.add_argument("--decode-tokens", type=int, default=None, help="timed decode steps per cache (default 16)")
    w.add_argument("--warmup", type=int, default=None, help="untimed steps per cache first (default 2)")
    w.add_argument("--attention-reps", type=int, default=None, help="repeats of the attention-alone timing (default 5)")
    w.add_argument("--no-stock", action="store_true",
                   help="skip plain transformers (DynamicCache, SDPA attention, no kvcompress code)")
    w.add_argument("--bandwidth-mib", type=int, default=512,
                   help="buffer streamed to measure the bandwidth floor, per context (0: skip; default 512)")
    w.add_argument("--on-infeasible", default="best_effort", choices=["best_effort", "error"],
                   help="a budget a method cannot reach: keep its smallest cache (default) or fail")
    w.add_argument("--quick", action="store_true",
                   help="smoke run: 512 tokens (synthetic: 1k, 1 layer), budget 0.25, the first preset, "
                        "3 decode tokens, no profile (explicit options still apply)")
    r = p.add_argument_group("run")
    r.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    r.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's choice; 1 is steadier on a loaded machine)")
    r.add_argument("--text", default=None, help="directory of .txt files or a text file for the contexts")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--no-profile", action="store_true", help="skip the profiles at the longest context")
    r.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"results JSON (default {DEFAULT_OUT})")
    r.add_argument("--plots-dir", type=Path, default=None, help="where PNGs go (default: the JSON's directory)")
    r.add_argument("--no-plots", action="store_true")
    r.add_argument("--no-progress", action="store_true", help="no progress bars")
    r.add_argument("--markdown", type=Path, default=None, help="also write markdown tables of the results here")
    r.add_argument("--merge", nargs="+", type=Path, default=None, metavar="JSON",
                   help="measure nothing: merge these results files (e.g. one per model) into --out, "
                        "re-evaluate the floors and redraw the plots")


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``bench`` on an argparse subparsers object; its default ``func`` is ``run``."""
    p = subparsers.add_parser(COMMAND, help=HELP, description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run, _run=run)
    return p


def settings_from_args(args):
    """BenchSettings from parsed arguments (``--quick`` fills what was not given)."""
    from .bench import BenchSettings
    from .bench.runner import DEFAULT_PRESETS

    quick = QUICK if args.quick else {}

    def pick(name, default):
        value = getattr(args, name)
        return value if value is not None else quick.get(name, default)

    presets = pick("presets", None)
    presets = _names(presets) if presets else (DEFAULT_PRESETS[:1] if args.quick else DEFAULT_PRESETS)
    return BenchSettings(
        models=_names(args.models),
        lengths=_ints(pick("lengths", "2k,4k,8k")),
        synthetic_lengths=_ints(pick("synthetic_lengths", "8k,16k,32k")),
        synthetic_layers=pick("synthetic_layers", 2),
        budgets=_floats(pick("budgets", "0.5,0.25,0.2")),
        presets=presets,
        backends=_names(args.backends),
        decode_tokens=pick("decode_tokens", 16),
        warmup=pick("warmup", 2),
        attention_reps=pick("attention_reps", 5),
        dtype=args.dtype,
        stock=not args.no_stock,
        bandwidth_bytes=args.bandwidth_mib * 1024 * 1024,
        on_infeasible=args.on_infeasible,
        profile=not args.no_profile and quick.get("profile", True),
        text=args.text,
        seed=args.seed,
        threads=args.threads,
        progress=not args.no_progress,
    )


def summary_lines(results: dict) -> list[str]:
    """Floors and the TPOT table as short text lines."""
    lines = []
    for f in results.get("floors", []):
        verdict = {True: "PASS", False: "FAIL", None: "not measured"}[f["pass"]]
        lines.append(f"floor {f['name']}: {verdict} -- {f['rule']}")
        for item in f.get("items", []):
            shown = {k: v for k, v in item.items() if k not in ("per_backend_ms",)}
            lines.append(f"    {shown}")
    lines.append("model            length  method        budget backend     TPOT ms  KV held MiB  compress s")
    for r in results.get("runs", []):
        lines.append(f"{r['model']:16s} {r['length']:6d}  {r['method']:13s} {str(r['budget']):6s} {r['backend']:10s} "
                     f"{r['tpot']['median_ms'] or float('nan'):8.1f}  {r['kv_bytes_held'] / 2**20:11.2f}  "
                     f"{r['compress_s']:10.3f}")
    return lines


def _own_argv(args) -> list[str]:
    """This command's arguments: ``main``'s argv, else sys.argv without the ``bench`` subcommand
    word that ``kvcompress bench`` puts first."""
    argv = getattr(args, "_argv", None)
    if argv is None:
        argv = sys.argv[1:]
        if argv[:1] == ["bench"]:
            argv = argv[1:]
    return list(argv)


def run(args) -> int:
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import json

    from .bench import run_bench

    command = "kvcompress bench " + " ".join(shlex.quote(a) for a in _own_argv(args))
    if args.merge:
        from .bench.runner import merge_results

        for path in args.merge:
            if not path.is_file():
                raise ValueError(f"merge={str(path)!r} is invalid: expected an existing results JSON file")
        results = merge_results([json.loads(p.read_text()) for p in args.merge])
        results["merged_by"] = command.strip()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    else:
        from .cli import check_input_file, check_output_dir, check_output_file

        settings = settings_from_args(args)  # bad values fail here, before any model loads
        check_output_file("--out", args.out)
        if args.plots_dir is not None and not args.no_plots:
            check_output_dir("--plots-dir", args.plots_dir)
        if args.markdown is not None:
            check_output_file("--markdown", args.markdown)
        if args.text is not None and not Path(args.text).is_dir():
            check_input_file("--text", Path(args.text))
        results = run_bench(settings, out=args.out, command=command.strip())
    if not args.no_plots:
        from .bench.plots import plot_results

        prefix = args.out.stem
        for path in plot_results(results, args.plots_dir or args.out.parent, prefix=prefix):
            print(f"wrote {path}", file=sys.stderr)
    if args.markdown is not None:
        from .bench.report import markdown

        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(markdown(results))
        print(f"wrote {args.markdown}", file=sys.stderr)
    print("\n".join(summary_lines(results)))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvcompress bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    args._argv = argv
    try:
        return run(args)
    except ValueError as exc:
        print(f"kvcompress bench: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
