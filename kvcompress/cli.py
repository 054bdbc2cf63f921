"""The ``kvcompress`` command line: ``kvcompress <command> [options]``.

Commands live in their own modules, ``kvcompress/cli_<name>.py``, found automatically. Each
defines:

    COMMAND = "demo"                      # the subcommand name
    HELP = "one line for kvcompress -h"
    def add_arguments(parser): ...        # argparse options (keep heavy imports out of here)
    def run(args) -> int: ...             # the exit status

so a new command (eval, bench, viz, ...) needs no change here.

Errors: a ValueError (bad input) or an OSError (a file) prints one line naming the argument, the
value and what is allowed, exit status 2; any other failure one line, exit status 1. ``--debug``
(anywhere on the line) shows the traceback instead. Commands check every argument before they
load a model, with the helpers below.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys
import time
from pathlib import Path
from types import ModuleType


def command_modules() -> dict[str, ModuleType]:
    """{command name: module} for every kvcompress/cli_*.py that defines a command."""
    import kvcompress

    found = {}
    for info in sorted(pkgutil.iter_modules(kvcompress.__path__), key=lambda m: m.name):
        if not info.name.startswith("cli_"):
            continue
        module = importlib.import_module(f"kvcompress.{info.name}")
        name = getattr(module, "COMMAND", None)
        if name and callable(getattr(module, "run", None)) and callable(getattr(module, "add_arguments", None)):
            found[name] = module
    return found


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (``prog: error: ... (see prog --help)``), exit 2,
    like every other bad argument; subcommand parsers inherit the class."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)\n")


def build_parser(modules: dict[str, ModuleType] | None = None) -> argparse.ArgumentParser:
    import kvcompress

    modules = command_modules() if modules is None else modules
    parser = OneLineParser(
        prog="kvcompress", description="KV-cache compression by semantic merging (SemantiCache, CentroidKV).")
    parser.add_argument("--version", action="version", version=f"kvcompress {kvcompress.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in modules.items():
        doc = (module.__doc__ or "").strip()
        cmd = sub.add_parser(name, help=getattr(module, "HELP", ""), description=doc,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(cmd)
        cmd.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("KVCOMPRESS_DEBUG") == "1"
    argv = [a for a in argv if a != "--debug"]
    parser = build_parser()
    parser.add_argument("--debug", action="store_true", help="show tracebacks (anywhere on the command line)")
    args = parser.parse_args(argv)
    if getattr(args, "_run", None) is None:
        parser.print_help()
        return 2
    prog = f"kvcompress {args.command}"
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError) as exc:  # bad input: the message says what is allowed
        if debug:
            raise
        print(f"{prog}: error: {one_line(exc)}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - one line, the traceback on request
        if debug:
            raise
        print(f"{prog}: failed: {type(exc).__name__}: {one_line(exc)} (--debug shows the traceback)",
              file=sys.stderr)
        return 1


def one_line(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        return f"{exc.strerror}: {exc.filename}"
    return " ".join(str(exc).split()) or type(exc).__name__


# ---------------------------------------------------------------------------- argument checks
def fail(flag: str, value, allowed: str):
    """Raise the one-line error of a bad argument: '--flag=value is invalid: expected allowed'."""
    raise ValueError(f"{flag}={str(value) if isinstance(value, Path) else value!r} is invalid: expected {allowed}")


def check_device(flag: str, device: str) -> None:
    """A torch device this build and machine have (cuda on a CPU-only build fails here)."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        fail(flag, device, "a torch device such as cpu, cuda or cuda:0")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            fail(flag, device, "cpu: this torch build or machine has no CUDA device")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            fail(flag, device, f"a CUDA device index < {torch.cuda.device_count()}")
    elif dev.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        fail(flag, device, "cpu: MPS is not available here")
    elif dev.type not in ("cpu", "cuda", "mps"):
        fail(flag, device, "cpu, cuda[:N] or mps")


def check_input_file(flag: str, path: Path) -> Path:
    path = Path(path)
    if not path.is_file():
        fail(flag, path, "an existing file" + (" (it is a directory)" if path.is_dir() else ""))
    if not os.access(path, os.R_OK):
        fail(flag, path, "a readable file")
    return path


def _first_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _check_writable(flag: str, path: Path, base: Path) -> None:
    """Create and remove a scratch directory in ``base``: permission bits alone miss read-only
    mounts and pseudo file systems (/proc), where the write would fail after all the work."""
    import tempfile

    try:
        os.rmdir(tempfile.mkdtemp(prefix=".kvcompress-check-", dir=base))
    except OSError as exc:
        fail(flag, path, f"a writable location ({base}: {exc.strerror or exc})")


def check_output_file(flag: str, path: Path | None) -> None:
    """A file that can be written: not a directory, under a directory (existing or creatable)."""
    if path is None:
        return
    path = Path(path)
    if path.is_dir():
        fail(flag, path, "a file path, not a directory")
    base = _first_existing(path.parent)
    if not base.is_dir():
        fail(flag, path, f"a path under a directory ({base} is a file)")
    if not os.access(base, os.W_OK):
        fail(flag, path, f"a writable location ({base} is not writable)")
    _check_writable(flag, path, base)


def check_output_dir(flag: str, path: Path) -> None:
    """A directory that exists or can be created."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        fail(flag, path, "a directory (this is a file)")
    base = _first_existing(path)
    if not base.is_dir():
        fail(flag, path, f"a directory path ({base} is a file)")
    if not os.access(base, os.W_OK):
        fail(flag, path, f"a writable location ({base} is not writable)")
    _check_writable(flag, path, base)


def check_context(flag: str, value, tokens: int, model: str | None, what: str) -> None:
    """A run whose longest sequence (tokens: context plus what is generated or teacher-forced) fits the
    model's context window; past it the positions are ones the model never saw."""
    from .hf.loading import context_window

    limit = context_window(model)
    if limit is not None and tokens > limit:
        fail(flag, value, f"{what} <= {limit}, the model's context window (here {tokens})")


def check_threads(flag: str, threads: int | None) -> None:
    """None (torch's default) or a thread count >= 1; applied with ``set_threads``."""
    if threads is not None and threads < 1:
        fail(flag, threads, "an integer >= 1 (torch threads)")


def set_threads(threads: int | None) -> None:
    if threads:
        import torch

        torch.set_num_threads(threads)


def check_pipeline(preset, overrides: dict, what: str):
    """The PipelineConfig of ``preset`` + ``overrides``, with every strategy built (so a bad
    parameter fails now, not after the model loads); ``what`` names the arguments in errors."""
    from .config import as_config
    from .pipeline import Pipeline

    try:
        config = as_config(preset, **overrides)
        Pipeline(config)
    except ValueError as exc:
        raise ValueError(f"{what}: {exc}") from None
    if config.max_slots is not None and config.max_slots <= config.sinks + config.recent:
        raise ValueError(f"{what}: max_slots={config.max_slots} is invalid: expected more than sinks + recent "
                         f"= {config.sinks} + {config.recent} slots (a keep-ratio is a float such as 0.2)")
    return config


class Progress:
    """One line per step on stderr: 'kvcompress demo: loading the model ... done in 46.1 s'."""

    def __init__(self, prog: str, enabled: bool = True):
        self.prog, self.enabled, self._start = prog, enabled, None

    def start(self, what: str) -> None:
        self._start = time.perf_counter()
        if self.enabled:
            print(f"{self.prog}: {what} ...", file=sys.stderr, flush=True)

    def done(self, what: str = "done") -> float:
        seconds = time.perf_counter() - (self._start or time.perf_counter())
        if self.enabled:
            print(f"{self.prog}: {what} in {seconds:.1f} s", file=sys.stderr, flush=True)
        return seconds


if __name__ == "__main__":
    sys.exit(main())
