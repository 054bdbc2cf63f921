"""The machine a benchmark ran on, described for the results file."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from pathlib import Path

import torch


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average() -> list[float] | None:
    """1, 5 and 15-minute load averages (None where the OS has none): on a shared machine they
    say how much the timings were contended."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def total_memory_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cpu_flags() -> list[str]:
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "fma")
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return [f for f in line.split(":", 1)[1].split() if f in wanted]
    except OSError:
        pass
    return []


def _compiler() -> str | None:
    try:
        out = subprocess.run(["gcc", "--version"], capture_output=True, text=True, timeout=10).stdout
        return out.splitlines()[0] if out else None
    except (OSError, subprocess.SubprocessError):
        return None


def describe_machine() -> dict:
    """CPU model and flags, cores, memory, torch / transformers / python versions, load."""
    try:
        import transformers

        tf_version = transformers.__version__
    except ImportError:  # the benchmark's models need it, the description does not
        tf_version = None
    cuda = torch.cuda.is_available()
    return {
        "cpu": cpu_model(),
        "cpu_flags": _cpu_flags(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_bytes": total_memory_bytes(),
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "torch": torch.__version__,
        "transformers": tf_version,
        "python": platform.python_version(),
        "compiler": _compiler(),
        "platform": platform.platform(),
        "load_average": load_average(),
    }


class Clock:
    """Wall time and this process's CPU time of a ``with`` block. On a shared machine the CPU time
    is the steadier figure: other processes stretch wall times unevenly.

        with Clock() as c:
            work()
        c.wall, c.cpu  # seconds
    """

    def __enter__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.wall
        self.cpu = time.process_time() - self.cpu

