"""`quantgate <verb>`: one CLI, thin over the Python APIs of each layer.

Each layer package owns a `cli.py` with `register(subparsers)`; handlers import their heavy
dependencies lazily so that `quantgate --help` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from quantgate import __version__
from quantgate.allocator import reexec_with_tcmalloc
from quantgate.env import apply_defaults

# Layer packages that contribute verbs, lowest layer first.
COMMAND_MODULES = [
    "quantgate.services_cli",
    "serving.cli",
    "fleet.cli",
    "quantize.cli",
    "evals.cli",
    "gates.cli",
    "gates.evidence_cli",
    "flows.cli",
    "benchmarks.cli",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="quantgate",
        description="Quantize a model, serve it through quantgate's paged-attention engine, "
        "evaluate each variant task by task, gate the release in MLflow.",
    )
    parser.add_argument("--version", action="version", version=f"quantgate {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="<verb>")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:
                continue
            raise
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the `quantgate` process itself (tests call main(argv) in theirs)
        reexec_with_tcmalloc([sys.executable, "-m", "quantgate", *sys.argv[1:]])
    apply_defaults()
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "passes_extra_args", False):
        parser.parse_args(argv)  # the usual error for unknown arguments
    if extra:
        args.script_args = [*getattr(args, "script_args", []), *extra]
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except ValueError as exc:  # bad input from the user: say what, no traceback
        print(f"quantgate {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except ConnectionError as exc:  # a store or server we depend on is down: not the user's input
        print(f"quantgate {args.command}: error: {exc}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
