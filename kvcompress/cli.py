"""The ``kvcompress`` command line: ``kvcompress <command> [options]``.

Commands live in their own modules, ``kvcompress/cli_<name>.py``, found automatically. Each
defines:

    COMMAND = "demo"                      # the subcommand name
    HELP = "one line for kvcompress -h"
    def add_arguments(parser): ...        # argparse options (keep heavy imports out of here)
    def run(args) -> int: ...             # the exit status

so a new command (eval, bench, viz, ...) needs no change here.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
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


def build_parser(modules: dict[str, ModuleType] | None = None) -> argparse.ArgumentParser:
    import kvcompress

    modules = command_modules() if modules is None else modules
    parser = argparse.ArgumentParser(
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
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if getattr(args, "_run", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except ValueError as exc:  # bad input: the message says what is allowed
        print(f"kvcompress {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
