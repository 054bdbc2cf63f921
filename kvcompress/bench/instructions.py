"""Instruction counts of phases of one process under valgrind's callgrind (work, not time).

Wall and CPU time on a shared machine carry its caches and contention; the number of instructions a
phase retires does not: it is deterministic for fixed inputs and threads, whatever else runs. It does
not see memory stalls, cache misses or page faults (the kernel is not counted), nor how many
instructions a cycle retires: it measures work, not time.

The process runs under ``valgrind --tool=callgrind --instr-atstart=no --dump-before=getppid``:
``instrument(True)`` switches the instrumentation on after the imports and the set-up (valgrind runs
uninstrumented code ~5x faster), and every ``Phases.mark(label)`` calls ``getppid()``, on which
callgrind writes the counts since the previous dump to ``<out>.<k>``; ``read_counts`` pairs the
k-th dump with the k-th label. Python calls ``getppid`` for nothing else here.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ENV = "KVCOMPRESS_CALLGRIND"  # set by the driver: this process runs under callgrind
_SUMMARY = re.compile(r"^summary:\s*(\d+)", re.M)


def under_callgrind() -> bool:
    return os.environ.get(ENV) == "1"


def instrument(on: bool) -> None:
    """Switch callgrind's instrumentation of this process on or off (no-op outside callgrind)."""
    if under_callgrind():
        subprocess.run(["callgrind_control", "-i", "on" if on else "off", str(os.getpid())], check=True,
                       capture_output=True)


class Phases:
    """Labels of the phases of one process, in order; ``mark`` closes the current phase."""

    def __init__(self):
        self.labels: list[str] = []

    def mark(self, label: str) -> None:
        self.labels.append(label)
        os.getppid()  # callgrind dumps the counts of the phase just closed


def callgrind_command(python: str, script: str, args: list[str], out_file: str) -> list[str]:
    """The valgrind command line a worker runs under (``out_file`` gets ``.<k>`` per dump)."""
    return ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--dump-before=getppid",
            f"--callgrind-out-file={out_file}", python, script, *args]


def dump_count(path: Path) -> int:
    """Instructions (Ir) in one callgrind dump file."""
    found = _SUMMARY.search(Path(path).read_text(errors="replace"))
    if not found:
        raise ValueError(f"no 'summary:' line in callgrind dump {path}")
    return int(found.group(1))


def read_counts(out_file: str, labels: list[str]) -> dict[str, int]:
    """{label: instructions} from the dumps ``<out_file>.1 ..`` of a process that marked ``labels``.

    The k-th ``mark`` wrote dump k; a missing dump (the process died) raises."""
    out = {}
    for k, label in enumerate(labels, start=1):
        path = Path(f"{out_file}.{k}")
        if not path.exists():
            raise FileNotFoundError(f"callgrind dump {path} for phase {label!r} is missing")
        out[label] = dump_count(path)
    return out


def marginal_exponents(lengths, counts) -> list[float]:
    """Exponent p of the growth beyond a fixed cost, per step of a geometric series of lengths.

    For counts c(N) = a + b N^p and lengths N, qN, q^2 N: (c(q^2 N) - c(qN)) / (c(qN) - c(N)) = q^p
    whatever the fixed part a (the Python and dispatch work of a call, which pulls a plain log-log
    slope below p at small N). One value per three consecutive lengths; nan where the counts do
    not grow. lengths must grow by the same factor."""
    import math

    ratios = {round(b / a, 9) for a, b in zip(lengths, lengths[1:])}
    if len(ratios) != 1 or ratios.pop() <= 1:
        raise ValueError(f"lengths {list(lengths)} are not a growing geometric series")
    q = lengths[1] / lengths[0]
    out = []
    for c0, c1, c2 in zip(counts, counts[1:], counts[2:]):
        d0, d1 = c1 - c0, c2 - c1
        out.append(math.log(d1 / d0) / math.log(q) if d0 > 0 and d1 > 0 else float("nan"))
    return out
