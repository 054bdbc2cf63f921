"""Compression cost against N in instructions (valgrind callgrind), not in time.

    python benchmarks/bench_cost_instructions.py --lengths 4096 8192 16384 32768 \
        --out benchmarks/results/cost_scaling_instructions.json
    python benchmarks/bench_cost_instructions.py --presets d2o --lengths 1024 2048 4096 --no-reference \
        --quadratic-reference --out /tmp/d2o.json         # the method checked on quadratic work

The same one layer of synthetic Llama-3-8B-shaped keys as ``bench_cost.py --scaling`` (8 KV heads x
128 dims, 32 query heads, keys around 64 prototypes + noise, real token ids); per preset and N, the
instructions one compression retires (``Pipeline(config)``, ``prepare`` when the preset needs all
layers, ``compress``: what ``kvcompress.bench.cost.compression_seconds`` times), and the log-log slope
of instructions against N. Beside them: the linear reference pass of ``bench_cost.py --scaling``
(slope 1 by construction) and, with ``--quadratic-reference``, a pass over all pairs of keys of each
head (slope 2 by construction): both check the method.

Each preset runs in its own process under ``valgrind --tool=callgrind`` (all in one with
``--one-process``; kvcompress.bench.instructions): the imports, the synthetic states and a first
compression at a quarter of the smallest length run uninstrumented; then, counted, that small
compression again (``warmup``), one compression per length, and the first length again (``repeat``:
the counts must agree, which says the numbers are deterministic). One torch thread, PYTHONHASHSEED=0, fixed seeds.

What an instruction count does and does not say: it is the work the CPU is asked to do, independent
of the load and of other processes, but not the time: memory stalls, cache misses and page faults
(kernel code is not counted) are not in it. Under valgrind the CPU reports no AVX-512, so torch runs
its AVX2 kernels (the same work in more, narrower instructions).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvcompress.bench import instructions  # noqa: E402  (torch-free)

RESULTS = ROOT / "benchmarks" / "results"
MAIN = ("streamingllm", "snapkv", "cam", "semanticache", "semanticache-safe", "centroidkv", "centroidkv-safe",
        "kvzip-gsc")
REFERENCE = "linear reference"
QUADRATIC = "quadratic reference"
WHAT = ("instructions retired (callgrind Ir), deterministic for fixed inputs: the work asked of the CPU, independent "
        "of the load; not time: memory stalls, cache misses and page faults (kernel code) are not counted; torch runs "
        "its AVX2 kernels under valgrind (no AVX-512 reported)")


def all_pairs_pass(states) -> None:
    """Every pair of unit keys of each head, in blocks of 1024 rows, reduced to a row maximum:
    N^2 x head_dim multiply-adds per head, quadratic by construction."""
    import torch

    for st in states:
        kn = torch.nn.functional.normalize(st.keys.float(), dim=-1)
        for s in range(0, kn.shape[2], 1024):
            (kn[:, :, s:s + 1024] @ kn.transpose(-1, -2)).amax(-1)


def worker(args) -> int:
    """Runs under callgrind: each named preset (or reference pass) at every length; writes its labels."""
    import torch

    from kvcompress.bench import cost
    from kvcompress.bench.sources import TINY_VOCAB, TokenSource, _smollm2_tokenizer
    from kvcompress.hf.vocab import token_texts
    from kvcompress.pipeline import Pipeline
    from kvcompress.presets import get_preset

    torch.set_num_threads(1)
    torch.manual_seed(0)
    tok = _smollm2_tokenizer()
    vocab = token_texts(tok) if tok is not None else TINY_VOCAB
    source = TokenSource(tok, vocab)
    lengths = sorted(set(args.lengths))
    warm_n = min(lengths) // 4 if min(lengths) >= 1024 else min(lengths)
    shape = dict(heads=args.kv_heads, q_heads=4 * args.kv_heads)  # Llama-3-8B: 4 query heads per KV head
    states = {n: cost.synthetic_states(n, token_ids=source.ids(n), vocab=vocab, **shape) for n in [warm_n, *lengths]}

    def runner(name):
        if name in (REFERENCE, QUADRATIC):
            run_pass = cost.reference_pass if name == REFERENCE else all_pairs_pass
            return lambda n: run_pass(states[n])
        config = get_preset(name, keep_ratio=args.keep, on_infeasible="best_effort")
        inputs = {n: cost.with_inputs(st, config) for n, st in states.items()}

        def run(n):
            pipe = Pipeline(config)
            if pipe.needs_all_layers:
                pipe.prepare(inputs[n])
            for i, st in enumerate(inputs[n]):
                pipe.compress(st, i)
        return run

    runs = {name: runner(name) for name in args.worker.split(",")}
    phases = instructions.Phases()
    with torch.inference_mode():
        for run in runs.values():
            run(warm_n)  # uninstrumented: the first-call paths run once before any count
        instructions.instrument(True)
        phases.mark("setup")
        for name, run in runs.items():
            run(warm_n)
            phases.mark(f"{name}|warmup {warm_n}")
            for n in lengths:
                run(n)
                phases.mark(f"{name}|N {n}")
            run(lengths[0])
            phases.mark(f"{name}|repeat {lengths[0]}")
    Path(args.labels).write_text(json.dumps(phases.labels))
    sys.stdout.flush()
    os._exit(0)  # the interpreter's teardown is not measured (and is slow under valgrind)


def measure(names: list[str], args, workdir: Path) -> dict:
    """{name: record} for ``names`` measured in one process under callgrind."""
    from kvcompress.bench.cost import loglog_slope

    slug = "+".join(n.replace(" ", "-") for n in names)
    out_file = str(workdir / f"cg.{slug}")
    labels = workdir / f"labels.{slug}.json"
    cmd = instructions.callgrind_command(sys.executable, str(Path(__file__).resolve()),
                                         ["--worker", ",".join(names), "--labels", str(labels), "--keep",
                                          str(args.keep), "--kv-heads", str(args.kv_heads), "--lengths", *map(str, args.lengths)], out_file)
    env = dict(os.environ, PYTHONHASHSEED="0", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               **{instructions.ENV: "1"})
    start = time.perf_counter()
    with open(workdir / f"log.{slug}.txt", "w") as logf:
        rc = subprocess.run(cmd, env=env, cwd=str(ROOT), stdout=logf, stderr=subprocess.STDOUT).returncode
    secs = time.perf_counter() - start
    if rc != 0 or not labels.exists():
        raise RuntimeError(f"{slug}: callgrind worker failed (rc {rc}), see {workdir}/log.{slug}.txt")
    counts = instructions.read_counts(out_file, json.loads(labels.read_text()))
    lengths = sorted(set(args.lengths))
    out = {}
    for name in names:
        mine = {k.split("|", 1)[1]: v for k, v in counts.items() if k.startswith(name + "|")}
        ins = [mine[f"N {n}"] for n in lengths]
        rec = {"lengths": lengths, "instructions": ins, "slope": loglog_slope(lengths, ins),
               "slopes_per_doubling": [loglog_slope(lengths[i:i + 2], ins[i:i + 2]) for i in range(len(lengths) - 1)],
               "instructions_per_token": [c / n for c, n in zip(ins, lengths)],
               "warmup": {k: v for k, v in mine.items() if k.startswith("warmup")},
               "repeat": mine[f"repeat {lengths[0]}"], "repeat_over_first": mine[f"repeat {lengths[0]}"] / ins[0],
               "process": slug, "process_valgrind_wall_s": secs}
        if len(lengths) > 2:
            try:
                rec["marginal_exponents"] = instructions.marginal_exponents(lengths, ins)
            except ValueError:
                pass  # not a geometric series of lengths
            rec["slope_upper_half"] = loglog_slope(lengths[len(lengths) // 2 - 1:], ins[len(lengths) // 2 - 1:])
        out[name] = rec
    return out


def function_counts(dump: Path, top: int) -> dict[str, int]:
    """{function: instructions} of the ``top`` functions of one dump (callgrind_annotate, self cost)."""
    text = subprocess.run(["callgrind_annotate", "--threshold=100", str(dump)], capture_output=True, text=True,
                          check=True).stdout
    out = {}
    for line in text.splitlines():
        found = re.match(r"^\s*([\d,]+) \(\s*[\d.]+%\)\s+(.*?)\s*$", line)
        if found and "PROGRAM TOTALS" not in line:
            name = found.group(2)
            name = name.split(":", 1)[1] if name.startswith(("???:", "./")) else name
            for noise in ("void c10::function_ref<void (char**, long const*, long, long)>::callback_fn<",
                          "at::TensorIteratorBase::loop_2d_from_1d<", "(anonymous namespace)::"):
                name = name.replace(noise, "")  # torch's kernel wrappers: keep the op's own name
            out[name[:200]] = out.get(name[:200], 0) + int(found.group(1).replace(",", ""))
            if len(out) >= top:
                break
    return out


def functions(args) -> int:
    """Per preset of --out, the top functions at each length from the dumps kept in --functions-from."""
    out = args.out or RESULTS / "cost_scaling_instructions.json"
    doc = json.loads(out.read_text())
    workdir = Path(args.functions_from)
    for labels_path in sorted(workdir.glob("labels.*.json")):
        slug = labels_path.name[len("labels."):-len(".json")]
        for k, label in enumerate(json.loads(labels_path.read_text()), start=1):
            name, _, phase = label.partition("|")
            if name in doc["presets"] and phase.startswith("N "):
                fns = function_counts(workdir / f"cg.{slug}.{k}", args.top)
                doc["presets"][name].setdefault("top_functions", {})[phase[2:]] = fns
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"results: {out}")
    return 0


def driver(args) -> int:
    from kvcompress.bench.machine import describe_machine, load_average

    names = list(args.presets) + ([REFERENCE] if args.reference else []) + ([QUADRATIC] if args.quadratic_reference
                                                                           else [])
    out = args.out or RESULTS / "cost_scaling_instructions.json"
    doc = json.loads(out.read_text()) if args.resume and out.exists() else {}
    doc.update({"benchmark": "compression cost against N in instructions (valgrind callgrind; one layer, synthetic "
                             "Llama-3-8B-shaped keys: 8 KV heads, head dim 128, 32 query heads)",
                "command": " ".join(["python", *sys.argv]), "keep_ratio": args.keep, "kv_heads": args.kv_heads, "query_heads": 4 * args.kv_heads,
                "head_dim": 128, "valgrind": subprocess.run(["valgrind", "--version"], capture_output=True, text=True).stdout.strip(),
                "what": WHAT,
                "machine": describe_machine(), "worker_torch_threads": 1})
    doc.setdefault("presets", {})
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="kvc-callgrind-"))
    workdir.mkdir(parents=True, exist_ok=True)
    todo = [n for n in names if not (n in doc["presets"] and doc["presets"][n]["lengths"] == sorted(set(args.lengths)))]
    groups = [todo] if args.one_process else [[n] for n in todo]
    for group in groups:
        if not group:
            continue
        recs = measure(group, args, workdir)
        for name, rec in recs.items():
            rec["load_average_after"] = load_average()
            doc["presets"][name] = rec
            print(f"{name:24s} slope {rec['slope']:.3f}  per doubling "
                  f"{' '.join(f'{s:.3f}' for s in rec['slopes_per_doubling'])}  repeat/first "
                  f"{rec['repeat_over_first']:.5f}", file=sys.stderr, flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1) + "\n")  # resumable: one process at a time
    for rec in doc["presets"].values():  # records of an earlier run (--resume) get the summaries too
        if "marginal_exponents" not in rec and len(rec["lengths"]) > 2:
            rec["marginal_exponents"] = instructions.marginal_exponents(rec["lengths"], rec["instructions"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    if not args.workdir and not args.keep_dumps:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"results: {out}")
    return 0


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", nargs="+", default=list(MAIN))
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    ap.add_argument("--keep", type=float, default=0.25)
    ap.add_argument("--kv-heads", type=int, default=8,
                    help="KV heads of the layer (head dim 128, 4 query heads each; bench_cost --scaling: 8)")
    ap.add_argument("--no-reference", dest="reference", action="store_false",
                    help="leave out the linear reference pass")
    ap.add_argument("--quadratic-reference", action="store_true", help="also the all-pairs pass (slope 2)")
    ap.add_argument("--one-process", action="store_true",
                    help="every preset in one valgrind process (one set-up, ~4 min at 32k; default: one each)")
    ap.add_argument("--resume", action="store_true", help="keep what --out holds, measure the rest")
    ap.add_argument("--workdir", default=None, help="where the callgrind dumps go (kept; default: a temp dir)")
    ap.add_argument("--keep-dumps", action="store_true", help="keep the temporary dumps (callgrind_annotate them)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--functions-from", default=None,
                    help="add each preset's top functions per length (callgrind_annotate) from the dumps of this "
                         "--workdir to --out, measuring nothing")
    ap.add_argument("--top", type=int, default=12, help="with --functions-from: functions kept per length")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--labels", default=None, help=argparse.SUPPRESS)
    return ap


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if len(set(args.lengths)) < 2 or min(args.lengths) < 16 or not 0 < args.keep < 1 or args.kv_heads < 1:
        ap.error("--lengths: at least two distinct lengths >= 16; 0 < --keep < 1; --kv-heads >= 1")
    if args.worker:
        return worker(args)
    if args.functions_from:
        return functions(args)
    from kvcompress.presets import list_presets

    unknown = [p for p in args.presets if p not in list_presets()]
    if unknown:
        ap.error(f"unknown presets {unknown}: expected names from kvcompress.list_presets()")
    if shutil.which("valgrind") is None:
        ap.error("valgrind is not installed (callgrind counts the instructions)")
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
