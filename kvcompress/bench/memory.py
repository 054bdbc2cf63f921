"""Peak resident memory of a phase (prefill, compression, a decode step), from the kernel.

tracemalloc does not see torch's CPU allocations and torch keeps no CPU allocator statistics,
so a phase's peak is the process's resident-set high-water mark: before the phase, free heap
memory goes back to the OS (glibc ``malloc_trim``) and the kernel's mark is reset (``5`` written
to ``/proc/self/clear_refs``); after it, ``VmHWM`` from ``/proc/self/status`` is the peak and
``peak - rss_before`` the phase's extra memory. This counts every allocation (torch, Python,
inductor), at page granularity, and only pages actually touched.

Without a resettable mark (not Linux), the peak is ``ru_maxrss``, which never goes down: the
delta is then only a lower bound (0 when an earlier phase peaked higher); ``method`` says which.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import re
import resource
import sys
from pathlib import Path

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


_LIBC = _libc()


def trim_heap() -> None:
    """Give free heap memory back to the OS, so the RSS before a phase is what is live."""
    fn = getattr(_LIBC, "malloc_trim", None) if _LIBC is not None else None
    if fn is not None:
        fn(0)


def _status_kib(field: str) -> int | None:
    try:
        match = re.search(rf"^{field}:\s+(\d+)\s+kB", _STATUS.read_text(), re.MULTILINE)
    except OSError:
        return None
    return None if match is None else int(match.group(1))


def rss_bytes() -> int:
    kib = _status_kib("VmRSS")
    if kib is not None:
        return kib * 1024
    return _maxrss_bytes()  # no /proc: the best available figure


def _maxrss_bytes() -> int:
    raw = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return raw if sys.platform == "darwin" else raw * 1024  # bytes on macOS, KiB on Linux


def _reset_mark() -> bool:
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


class PeakRSS:
    """Context manager: ``start`` (RSS before), ``peak`` and ``delta`` (peak - start), in bytes.

        with PeakRSS() as mem:
            run_phase()
        mem.delta
    """

    def __init__(self):
        self.start = self.peak = self.delta = 0
        self.method = ""

    def __enter__(self) -> "PeakRSS":
        trim_heap()
        resettable = _reset_mark() and _status_kib("VmHWM") is not None
        self.method = "VmHWM after clear_refs" if resettable else "ru_maxrss (not resettable: lower bound)"
        self._before_max = None if resettable else _maxrss_bytes()
        self.start = rss_bytes()
        return self

    def __exit__(self, *exc) -> None:
        if self._before_max is None:
            self.peak = max((_status_kib("VmHWM") or 0) * 1024, rss_bytes())
        else:
            self.peak = max(_maxrss_bytes(), rss_bytes())
            self.peak = self.peak if self.peak > self._before_max else self.start
        self.delta = max(0, self.peak - self.start)

    def as_dict(self) -> dict:
        return {"rss_before": self.start, "peak": self.peak, "delta": self.delta}


METHOD_DOC = __doc__
