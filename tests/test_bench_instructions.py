"""Instruction counts per phase under callgrind (kvcompress.bench.instructions and
benchmarks/bench_cost_instructions.py): dump parsing, the phase marks, and, where valgrind is
installed, the method itself on pure-Python work of known growth (seconds; no torch under valgrind)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvcompress.bench import instructions

ROOT = Path(__file__).resolve().parents[1]


def _dump(path: Path, count: int) -> None:
    path.write_text(f"# callgrind format\nversion: 1\ncmd: python\npart: 1\nevents: Ir\n"
                    f"fl=(1) x.c\nfn=(1) f\n0 {count}\nsummary: {count}\n\ntotals: {count}\n")


def test_read_counts_pairs_the_kth_dump_with_the_kth_label(tmp_path):
    out = tmp_path / "cg.x"
    for k, c in enumerate([7, 1000, 2000], start=1):
        _dump(Path(f"{out}.{k}"), c)
    assert instructions.read_counts(str(out), ["setup", "N 4", "N 8"]) == {"setup": 7, "N 4": 1000, "N 8": 2000}
    with pytest.raises(FileNotFoundError, match="'N 16'"):
        instructions.read_counts(str(out), ["setup", "N 4", "N 8", "N 16"])
    Path(f"{out}.4").write_text("events: Ir\n")
    with pytest.raises(ValueError, match="summary"):
        instructions.read_counts(str(out), ["setup", "N 4", "N 8", "N 16"])


def test_marks_call_getppid_once_each_and_instrument_is_a_noop_outside_callgrind(monkeypatch):
    calls = []
    monkeypatch.setattr(instructions.os, "getppid", lambda: calls.append(1) or 1)
    monkeypatch.delenv(instructions.ENV, raising=False)
    monkeypatch.setattr(instructions.subprocess, "run", lambda *a, **k: pytest.fail("callgrind_control called"))
    phases = instructions.Phases()
    instructions.instrument(True)
    phases.mark("a")
    phases.mark("b")
    assert phases.labels == ["a", "b"] and len(calls) == 2


WORK = """
import gc, importlib.util, json, sys
gc.disable()  # a collection falls into whichever phase crosses its threshold
spec = importlib.util.spec_from_file_location("instructions", sys.argv[1])
ins = importlib.util.module_from_spec(spec); spec.loader.exec_module(ins)
def work(n):
    total = 0
    for i in range(n):
        total += i * i
    return total
def pairs(n):
    xs, c = [None] * n, 0  # no small-int cache effects: the same work per pair at every n
    for a in xs:
        for b in xs:
            c += 1
    return c
work(80000); pairs(10)  # the allocator grown once, before any count
ins.instrument(True)
phases = ins.Phases()
phases.mark("setup")
work(20000); phases.mark("warm")  # the first counted phase of a process runs a few more
for n in (20000, 40000, 80000):
    work(n); phases.mark(f"linear {n}")
for n in (100, 200, 400):
    pairs(n); phases.mark(f"quadratic {n}")
work(20000); phases.mark("repeat")
json.dump(phases.labels, open(sys.argv[2], "w"))
"""


@pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind is not installed")
def test_callgrind_counts_give_slope_one_for_linear_work_and_two_for_all_pairs(tmp_path):
    """The method, end to end: instructions of a linear loop grow with slope ~1, of all pairs with
    slope ~2, and a repeat of the same phase counts the same."""
    from kvcompress.bench.cost import loglog_slope

    script, labels, out = tmp_path / "work.py", tmp_path / "labels.json", str(tmp_path / "cg.work")
    script.write_text(WORK)
    cmd = instructions.callgrind_command(sys.executable, str(script),
                                         [str(ROOT / "kvcompress" / "bench" / "instructions.py"), str(labels)], out)
    env = dict(os.environ, PYTHONHASHSEED="0", **{instructions.ENV: "1"})
    subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=300)
    counts = instructions.read_counts(out, json.loads(labels.read_text()))
    lin = [counts[f"linear {n}"] for n in (20000, 40000, 80000)]
    quad = [counts[f"quadratic {n}"] for n in (100, 200, 400)]
    assert abs(loglog_slope([1, 2, 4], lin) - 1.0) < 0.05
    assert abs(loglog_slope([1, 2, 4], quad) - 2.0) < 0.05
    # the same phase again, after other work: within a few percent (the allocator's state differs)
    assert abs(counts["repeat"] / lin[0] - 1.0) < 0.05


def test_bench_rejects_bad_arguments_before_any_work():
    spec = importlib.util.spec_from_file_location("bench_cost_instructions",
                                                  ROOT / "benchmarks" / "bench_cost_instructions.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for argv in (["--presets", "no-such-preset"], ["--lengths", "4096"], ["--lengths", "8", "16"],
                 ["--keep", "0"], ["--kv-heads", "0"]):
        with pytest.raises(SystemExit) as exc:
            bench.main(argv)
        assert exc.value.code == 2


def test_marginal_exponent_sees_through_a_fixed_cost():
    lengths = [1024, 2048, 4096, 8192]
    for p in (1.0, 1.5, 2.0):
        counts = [5e6 + 3.0 * n ** p for n in lengths]
        assert all(abs(e - p) < 1e-9 for e in instructions.marginal_exponents(lengths, counts))
    nlogn = [n * math.log(n) for n in lengths]
    assert all(1.0 < e < 1.15 for e in instructions.marginal_exponents(lengths, nlogn))
    with pytest.raises(ValueError, match="geometric"):
        instructions.marginal_exponents([1, 2, 5], [1, 2, 3])


def test_performance_page_commands_parse():
    """The bench_cost_instructions.py commands docs/performance.md gives parse, and name real presets."""
    from kvcompress.presets import list_presets
    from test_bench import _doc_commands

    spec = importlib.util.spec_from_file_location("bench_cost_instructions",
                                                  ROOT / "benchmarks" / "bench_cost_instructions.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    cmds = _doc_commands("python benchmarks/bench_cost_instructions.py")
    assert len(cmds) >= 3
    for argv in cmds:
        args = bench.parser().parse_args(argv)
        assert set(args.presets) <= set(list_presets())
