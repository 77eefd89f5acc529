"""What the ``ngram-cupy`` commands share: user errors, sizes, configs and layouts, checks of
the input and output files, atomic outputs and progress bars."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import time
from collections.abc import Iterator
from fractions import Fraction
from typing import Any

from ..hashing.config import NGramConfig
from ..hashing.layout import LayerLayout, layer_layout
from ..runtime import interrupts
from ..runtime.atomic import atomic_file
from ..runtime.backends import gpu_available

PROG = "ngram-cupy"
EXIT_USAGE = 2
EXIT_SIGINT = 130

MAX_BYTES = (1 << 63) - 1
_BYTE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40,
               "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
               "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


class UserError(Exception):
    """A mistake in the command's arguments or inputs: reported in one line, exit status 2."""


def parse_bytes(text: str) -> int:
    """Bytes from ``80GiB``, ``80G`` (binary), ``80GB`` (decimal) or a plain number."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _BYTE_UNITS:
        raise argparse.ArgumentTypeError(
            f"not a size: {text!r} (examples: 80GiB, 512G, 1.5TB, 4096)")
    number = match.group(1)
    if len(number) > 40:  # Fraction of a 400-digit number is fine, but no memory is that big
        raise argparse.ArgumentTypeError(f"not a size: {text[:40]!r}... is far too large")
    size = int(Fraction(number) * _BYTE_UNITS[match.group(2).lower()])
    if size > MAX_BYTES:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} is larger than 8 EiB")
    return size


def load_config(path: str) -> NGramConfig:
    """The model config at ``path``; any problem with it is a ``UserError`` naming the file."""
    try:
        return NGramConfig.from_hf(path)
    except (ValueError, TypeError) as e:
        raise UserError(f"bad config {path}: {e}") from None


def layouts_for(config: NGramConfig, layers: list[int]) -> list[LayerLayout]:
    """The layouts of the chosen PLE layers (no more than the config's ``ple_layer_ids`` name)."""
    count = len(config.ple_layer_ids) if config.ple_layer_ids is not None else None
    negative = [layer for layer in layers if layer < 0]
    if negative:
        which = f"0..{count - 1}" if count else "0, 1, ..."
        raise UserError(f"layer {negative[0]} is not a PLE layer: layers are counted from 0 "
                        f"({which})")
    beyond = [layer for layer in layers if count is not None and layer >= count]
    if beyond:
        raise UserError(f"layer {beyond[0]} is beyond the config's {count} PLE layers "
                        f"(ple_layer_ids; layers are 0-based)")
    try:
        return [layer_layout(config, layer) for layer in layers]
    except (ValueError, TypeError) as e:
        raise UserError(f"bad layer: {e}") from None


def load_engram(args: argparse.Namespace, need_tokenizer: bool):
    """``(EngramConfig, EngramLayout or None)`` from ``--config`` and ``--tokenizer``."""
    from ..hashing.engram_config import EngramConfig
    from ..hashing.engram_layout import engram_layout
    from ..hashing.token_map import engram_token_map

    try:
        config = EngramConfig.from_hf(args.config)
    except (ValueError, TypeError) as e:
        raise UserError(f"bad config {args.config}: {e}") from None
    if args.tokenizer is None:
        if need_tokenizer:
            raise UserError("--scheme engram needs --tokenizer (the model's tokenizer.json: its "
                            "compressed token map)")
        return config, None
    return config, engram_layout(config, engram_token_map(args.tokenizer))


def check_files(source: Any, mapper: Any) -> None:
    """Every file of a folder must have the token or text (and document-id) columns in a type
    ``mapper`` takes: a ``UserError`` naming the file, never a silent cast or a column of nulls."""
    if len(source.files) < 2:
        return
    for path, schema in source.files:
        try:
            mapper.output_schema(schema)
        except (ValueError, TypeError) as e:
            raise UserError(f"{path}: {e}") from None


def check_output(output: str, inputs: list[str]) -> None:
    """Refuse, before anything is read or written, an OUTPUT that is a folder, lies in no folder
    or in one this process cannot write, or is (through links, relative paths or a folder) one of
    the files read."""
    if os.path.isdir(output) or output.endswith(os.sep):
        raise UserError(f"output is a directory: {output}")
    if os.path.exists(output) and not os.path.isfile(output):
        raise UserError(f"output exists and is not a regular file (a device, FIFO or socket "
                        f"would be replaced): {output}")
    folder = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(folder):
        raise UserError(f"output folder does not exist: {folder}")
    if not os.access(folder, os.W_OK | os.X_OK):  # a read-only file system included (EROFS)
        raise UserError(f"output folder is not writable: {folder}")
    real = os.path.realpath(output)
    for path in inputs:
        source = os.path.realpath(path)
        if os.path.isdir(source):
            if os.path.commonpath([source, real]) == source:
                raise UserError(f"OUTPUT {output} lies inside the INPUT folder {path}")
        elif real == source or (os.path.exists(output) and os.path.exists(path)
                                and os.path.samefile(output, path)):
            raise UserError(f"OUTPUT {output} is the INPUT file {path}")


def check_output_is_not_read(output: str, source: Any) -> None:
    """OUTPUT must not be a hard link to a file of INPUT."""
    check_output(output, [path for path, _ in source.files])


@contextlib.contextmanager
def atomic_output(path: str) -> Iterator[str]:
    """A temporary path beside ``path``, renamed onto it on success and removed on any failure
    (an interrupt included, even one swallowed on the way)."""
    check_output(path, [])
    with atomic_file(path) as temporary:
        yield temporary
        interrupts.check()


def token_count(batch: Any, column: str) -> int:
    """Tokens in a batch's list column, from its offsets."""
    offsets = batch.column(column).offsets
    return offsets[-1].as_py() - offsets[0].as_py() if len(offsets) else 0


def whole_run(args: argparse.Namespace) -> str:
    """The time since ``main`` began the command (imports, tokenizer and kernels included), for
    a summary that times only part of the run: ``"the whole command 12.9 s"``."""
    return f"the whole command {time.perf_counter() - args.started:.1f} s"


def check_device(device: str) -> None:
    """``--device gpu`` needs CuPy and a visible CUDA device."""
    if device == "gpu" and not gpu_available():
        raise UserError("--device gpu: no usable CUDA device (it needs CuPy, a CUDA driver and a "
                        "visible device)")


def terminal_columns() -> int:
    """The width stderr's terminal reports (0 for a terminal that reports none, or no terminal)."""
    try:
        return os.get_terminal_size(sys.stderr.fileno()).columns
    except (OSError, ValueError, AttributeError):
        return 0


def progress_bar(total: int | None, quiet: bool, what: str):
    """A tqdm bar on stderr counting rows; off with ``--quiet`` and when stderr is not a TTY.

    A terminal that reports width 0 (some serial consoles and containers) gets 80 columns: tqdm
    would otherwise draw nothing.
    """
    from tqdm import tqdm

    width = terminal_columns()
    return tqdm(total=total, desc=what, unit=" rows", unit_scale=True, file=sys.stderr,
                disable=True if quiet else None, dynamic_ncols=width > 0,
                ncols=None if width > 0 else 80)


def text_column_of(args: argparse.Namespace, source: Any) -> str | None:
    """The column to tokenize: ``--text-column``'s, or the lines of a plain text ``source``
    (which need ``--tokenizer``)."""
    if source.text_column is None:
        return args.text_column
    if args.tokenizer is None:
        raise UserError(f"{args.input} is plain text (one document per line): its lines need "
                        f"--tokenizer")
    return source.text_column


def text_options(args: argparse.Namespace, source: Any) -> dict[str, Any]:
    """``text_column`` and ``tokenizer`` keywords from ``--text-column`` and ``--tokenizer``, or
    a plain text ``source``'s lines."""
    text_column = text_column_of(args, source)
    if (text_column is None) != (args.tokenizer is None):
        raise UserError("--text-column and --tokenizer go together")
    return {"text_column": text_column, "tokenizer": args.tokenizer}


def add_input_options(sub: argparse.ArgumentParser) -> None:
    """The options of the commands that read a token or text file: config, columns, batch size."""
    sub.add_argument("--config", required=True,
                     help="model config.json (or a folder holding one)")
    sub.add_argument("--column", default="tokens", help="token column (default: tokens); "
                     "with --text-column, the name of the token column written")
    sub.add_argument("--text-column", metavar="NAME",
                     help="tokenize this text column (string) first, with --tokenizer (a JSON "
                     "Lines field; plain text: the name of its lines' column, default text)")
    sub.add_argument("--tokenizer", metavar="SPEC",
                     help="qwen3.5 (alias qwen3.6: the released model's tokenizer) or a path "
                     "to a tokenizer.json (needs the text extra)")
    sub.add_argument("--doc-id-column", help="document-id column: consecutive rows with the "
                     "same id continue one document (default: every row is fresh)")
    sub.add_argument("--batch-rows", type=int, default=256,
                     help="rows per batch read (bounds memory; default 256)")
    sub.add_argument("--quiet", action="store_true", help="no progress bar or summary")
