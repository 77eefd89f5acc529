"""``ngram-cupy quantize``: a model's n-gram tables quantised, in a new checkpoint."""

from __future__ import annotations

import argparse
import os
import time

from ..formats import ENCODED
from .common import UserError


def targets_help() -> str:
    """Each format ``--to`` takes and the model families whose checkpoints hold it."""
    return ", ".join(f"{to} ({' and '.join(family for family, _ in fmt.checkpoints)})"
                     for to, fmt in ENCODED.items())


def layer_list(text: str) -> list[int]:
    """The layers of one ``--layers`` value: ``0,2`` (several values are not taken, so that
    ``--layers`` never swallows OUTPUT)."""
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a list of layers: {text!r} (one comma-separated value, e.g. --layers 0,2)"
            ) from None


def model_folder(path: str) -> str:
    """The model folder named by ``path``: a path to its ``config.json`` is taken as the folder."""
    if os.path.basename(path) == "config.json" and os.path.isfile(path):
        return os.path.dirname(path) or "."
    return path


def cmd_quantize(args: argparse.Namespace) -> int:
    """``quantize``: a model's n-gram tables to a quantised format, in a new checkpoint."""
    from ..files.quantize_checkpoint import quantize_checkpoint

    if args.layers is not None and args.output.isdigit():  # "--layers 0 1 --to ...": 1 is OUTPUT
        raise UserError(f"OUTPUT {args.output!r} looks like a layer: --layers takes one "
                        f"comma-separated value (--layers 0,1); write ./{args.output} for a "
                        f"folder of that name")
    start = time.perf_counter()
    quantize_checkpoint(model_folder(args.model), args.to, args.output, args.layers,
                        args.scheme, progress=False if args.quiet else None)
    if not args.quiet:
        print(f"wrote {args.output}: {args.to} tables in {time.perf_counter() - start:.2f} s")
    return 0


def add_parser(commands) -> None:
    """Add the ``quantize`` command to the sub-parsers ``commands``."""
    quantize = commands.add_parser(
        "quantize", help=f"quantise a model's n-gram tables to {', '.join(ENCODED)}",
        description="Write MODEL (a folder with config.json and safetensors) into the new "
        "folder OUTPUT with its float n-gram tables quantised, in the engine's names.")
    quantize.add_argument("model", metavar="MODEL", help="model folder (or its config.json)")
    quantize.add_argument("--to", required=True, choices=list(ENCODED),
                          help=f"format: {targets_help()}")
    quantize.add_argument("output", metavar="OUTPUT", help="new folder to write (must not "
                          "exist; appears complete or not at all)")
    quantize.add_argument("--layers", type=layer_list, action="extend", metavar="L,L,...",
                          help="PLE (or Engram) layers, 0-based, comma-separated: --layers 0,2 "
                          "(default: all)")
    quantize.add_argument("--scheme", choices=["qwen4exp", "engram"], default="qwen4exp",
                          help="model family (default qwen4exp)")
    quantize.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    quantize.set_defaults(run=cmd_quantize)
