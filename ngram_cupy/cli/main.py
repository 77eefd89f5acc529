"""The ``ngram-cupy`` command line: n-gram ids of token or text files, table layouts, statistics,
and GPU kernels built ahead into the kernel cache.

User mistakes (missing files, a wrong column, a bad config) print one line on stderr and exit
with status 2; an interrupted run exits with 130 (SIGINT) or 143 (SIGTERM) and leaves no output.
"""

from __future__ import annotations

import argparse
import sys
import time

from ..runtime import interrupts
from . import compile as compile_command
from . import ids, info, layout, quantize, stats
from .common import EXIT_SIGINT, EXIT_USAGE, PROG, UserError

COMMANDS = (ids, layout, stats, compile_command, quantize, info)  # in the order --help lists them


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line on stderr (exit 2), like every user error."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {' '.join(message.split())}\n")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser: each command's module adds its own sub-parser."""
    from .._version import package_version

    parser = OneLineParser(
        prog=PROG, description="Exact hashed n-gram (PLE) ids, table layouts and hash statistics.")
    parser.add_argument("--version", action="version", version=f"{PROG} {package_version()}",
                        help="print the version and exit (`ngram-cupy info`: the backends too)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(commands)
    return parser


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean bad input rather than a bug: reported in one line."""
    errors: tuple[type[BaseException], ...] = (UserError, ValueError, TypeError, OSError,
                                               ImportError)
    arrow_error = getattr(sys.modules.get("pyarrow"), "ArrowException", None)
    if arrow_error is not None:  # pyarrow imported (and not blocked)
        errors += (arrow_error,)
    return errors


def main(argv: list[str] | None = None) -> int:
    """Run one command; return its exit status."""
    started = time.perf_counter()  # the command's summary gives its whole time from here
    args = build_parser().parse_args(argv)
    args.started = started
    if getattr(args, "batch_rows", 1) < 1:
        print(f"{PROG}: error: --batch-rows must be at least 1", file=sys.stderr)
        return EXIT_USAGE
    try:
        with interrupts.honoured():
            return args.run(args)
    except interrupts.Interrupted as e:
        print(f"{PROG}: interrupted ({e})", file=sys.stderr)
        return e.exit_status
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return EXIT_SIGINT
    except _user_errors() as e:
        print(f"{PROG}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return EXIT_USAGE
