"""``ngram-cupy quantize``: a model's n-gram tables quantised, in a new checkpoint."""

from __future__ import annotations

import argparse
import time

from ..formats import ENCODED


def targets_help() -> str:
    """Each format ``--to`` takes and the model families whose checkpoints hold it."""
    return ", ".join(f"{to} ({' and '.join(family for family, _ in fmt.checkpoints)})"
                     for to, fmt in ENCODED.items())


def cmd_quantize(args: argparse.Namespace) -> int:
    """``quantize``: a model's n-gram tables to a quantised format, in a new checkpoint."""
    from ..files.quantize_checkpoint import quantize_checkpoint

    start = time.perf_counter()
    quantize_checkpoint(args.model, args.to, args.output, args.layers, args.scheme,
                        progress=False if args.quiet else None)
    if not args.quiet:
        print(f"wrote {args.output}: {args.to} tables in {time.perf_counter() - start:.2f} s")
    return 0


def add_parser(commands) -> None:
    """Add the ``quantize`` command to the sub-parsers ``commands``."""
    quantize = commands.add_parser(
        "quantize", help=f"quantise a model's n-gram tables to {', '.join(ENCODED)}",
        description="Write MODEL (a folder with config.json and safetensors) into the new "
        "folder OUTPUT with its float n-gram tables quantised, in the engine's names.")
    quantize.add_argument("model", metavar="MODEL_OR_CHECKPOINT", help="model folder")
    quantize.add_argument("--to", required=True, choices=list(ENCODED),
                          help=f"format: {targets_help()}")
    quantize.add_argument("output", metavar="OUTPUT", help="new folder to write (must not "
                          "exist; appears complete or not at all)")
    quantize.add_argument("--layers", type=int, nargs="+", metavar="L",
                          help="PLE (or Engram) layers, 0-based (default: all)")
    quantize.add_argument("--scheme", choices=["qwen4exp", "engram"], default="qwen4exp",
                          help="model family (default qwen4exp)")
    quantize.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    quantize.set_defaults(run=cmd_quantize)
