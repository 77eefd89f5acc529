"""``ngram-cupy ids``: n-gram (or Engram) id columns of a token or text file, into Parquet."""

from __future__ import annotations

import argparse
import sys
import threading
import time
from typing import Any

from ..hashing.layout import LayerLayout
from ..runtime import interrupts
from .common import (
    PROG,
    UserError,
    add_input_options,
    atomic_output,
    check_device,
    check_files,
    check_output,
    check_output_is_not_read,
    layouts_for,
    load_config,
    load_engram,
    progress_bar,
    text_column_of,
    text_options,
    token_count,
    whole_run,
)


def compile_kernels(layouts: list[LayerLayout], schema: Any, column: str, quiet: bool) -> float:
    """Compile (or load from cache) the CPU id kernels for the input's types before the clock
    starts; on a terminal, say so when it takes long (a first run). Returns the seconds."""
    from ..files.token_columns import check_token_type
    from ..ids.ids_numba import compile_kernels as compile_ids

    token_type = schema.field(column).type
    check_token_type(column, token_type)
    notice = threading.Timer(1.0, lambda: print(
        f"{PROG}: compiling kernels (once: later runs load them from Numba's cache)...",
        file=sys.stderr, flush=True))
    if not quiet and sys.stderr.isatty():  # as the progress bar: nothing in logs
        notice.start()
    start = time.perf_counter()
    try:
        for layout in layouts:
            compile_ids(layout, token_type.value_type.to_pandas_dtype())
    finally:
        notice.cancel()
    return time.perf_counter() - start


def cmd_ids(args: argparse.Namespace) -> int:
    """Stream INPUT through the id columns into OUTPUT (Parquet), atomically."""
    if args.scheme == "engram":
        return cmd_engram_ids(args)
    from ..arrow import NGramIds, ids_metadata, out_of_vocabulary
    from ..files.pipeline import tokens_per_call, write_ids, writer_options
    from ..files.token_columns import TextError
    from ..files.token_files import open_tokens, token_slices

    check_output(args.output, [args.input])
    layouts = layouts_for(load_config(args.config), args.layers or [0])
    check_device(args.device)
    source = open_tokens(args.input, args.batch_rows, args.text_column)
    check_output_is_not_read(args.output, source)
    mapper = NGramIds(layouts[0] if len(layouts) == 1 else layouts, args.column,
                      args.out_column, args.doc_id_column, args.device,
                      id_type=args.id_type, **text_options(args, source))
    check_files(source, mapper)
    schema = mapper.output_schema(source.schema)
    schema = schema.with_metadata({**(schema.metadata or {}), **ids_metadata(
        layouts[0] if len(layouts) == 1 else layouts, args.out_column, args.column)})
    compiled = 0.0
    if args.device == "cpu":
        compiled = compile_kernels(layouts, schema, args.column, args.quiet)
    rows = tokens = outside = 0
    vocab_size = layouts[0].config.vocab_size
    start = time.perf_counter()  # after compiling: the rate counts the work, not the compiler
    with atomic_output(args.output) as tmp, progress_bar(source.num_rows, args.quiet,
                                                         "ids") as bar:
        def progress(batch: Any) -> None:
            nonlocal rows, tokens, outside
            interrupts.check()  # a signal swallowed while compiling still stops the run
            rows += batch.num_rows
            tokens += token_count(batch, args.column)
            outside += out_of_vocabulary(batch.column(args.column).flatten().to_numpy(),
                                         vocab_size)
            bar.update(batch.num_rows)
            elapsed = max(time.perf_counter() - start, 1e-9)
            bar.set_postfix_str(f"{bar.format_sizeof(tokens / elapsed)} tokens/s", refresh=False)

        per_call = tokens_per_call(layouts[0].num_heads, mapper.id_dtype.itemsize)
        try:
            write_ids(token_slices(source.batches(), args.column, per_call), mapper, tmp, schema,
                      writer_options(schema, source.schema, args.compression), progress)
        except TextError as e:
            raise UserError(f"{args.input}: {e}") from None
    elapsed = time.perf_counter() - start
    if not args.quiet:
        ready = f"; kernels compiled in {compiled:.1f} s before" if compiled >= 0.5 else ""
        print(f"wrote {args.output}: {rows:,} rows, {tokens:,} tokens, {len(layouts)} layer(s): "
              f"read, computed and written in {elapsed:.2f} s "
              f"({tokens / max(elapsed, 1e-9) / 1e6:.1f} Mtokens/s{ready}; {whole_run(args)})")
        if outside:
            print(f"note: {outside:,} token(s) lie outside the vocabulary [0, {vocab_size:,}) "
                  "(negative or too large); they are hashed as the model hashes them, but "
                  "usually mean a tokenizer that does not match the config")
    return 0


def cmd_engram_ids(args: argparse.Namespace) -> int:
    """``ids --scheme engram``: every row a whole sequence, ``[T, L, H]`` int32 ids per row."""
    from ..arrow import TextTokens
    from ..files.engram_parquet import EngramIds, write_engram_ids
    from ..files.token_columns import TextError
    from ..files.token_files import open_tokens

    if args.doc_id_column is not None:
        raise UserError("--doc-id-column is not supported with --scheme engram (every row is "
                        "one whole sequence)")
    if args.layers is not None:
        raise UserError("--layers is not supported with --scheme engram (one column holds "
                        "every Engram layer's ids, [T, L, H] per row)")
    if args.id_type == "int64":
        raise UserError("--id-type int64 is not supported with --scheme engram (its ids are "
                        "int32, as the model reads them)")
    check_output(args.output, [args.input])
    _, layout = load_engram(args, need_tokenizer=True)
    check_device(args.device)
    source = open_tokens(args.input, args.batch_rows, args.text_column)
    check_output_is_not_read(args.output, source)
    text_column = text_column_of(args, source)
    text = None if text_column is None else TextTokens(args.tokenizer, text_column, args.column)
    to_device = None
    if args.device == "gpu":
        import cupy

        to_device = cupy.asarray
    mapper = EngramIds(layout, args.column, args.out_column or "engram_ids", text, to_device)
    check_files(source, mapper)
    mapper.output_schema(source.schema)
    rows = tokens = 0
    start = time.perf_counter()
    with atomic_output(args.output) as tmp, progress_bar(source.num_rows, args.quiet,
                                                         "engram ids") as bar:
        def progress(batch: Any) -> None:
            nonlocal rows, tokens
            interrupts.check()
            rows += batch.num_rows
            tokens += token_count(batch, args.column)
            bar.update(batch.num_rows)

        try:
            write_engram_ids(source.batches(), mapper, tmp, source.schema, args.compression,
                             progress)
        except TextError as e:
            raise UserError(f"{args.input}: {e}") from None
    if not args.quiet:
        elapsed = time.perf_counter() - start
        print(f"wrote {args.output}: {rows:,} rows, {tokens:,} tokens, Engram layers "
              f"{list(layout.layer_ids)}: read, computed and written in {elapsed:.2f} s"
              f" ({whole_run(args)})")
    return 0


def add_parser(commands) -> None:
    """Add the ``ids`` command to the sub-parsers ``commands``."""
    ids = commands.add_parser("ids", help="write n-gram ids of a token or text file",
                              description="Stream INPUT (Parquet file or folder, Arrow IPC, "
                              "plain text or JSON Lines) and write it to OUTPUT (Parquet) with "
                              "n-gram id columns.")
    ids.add_argument("input", metavar="INPUT", help="Parquet file or folder of Parquet files, an "
                     "Arrow IPC file or stream, with a token (or text) column; or plain text "
                     "(.txt: one document per line) or JSON Lines (.jsonl, .ndjson, .json), "
                     "either maybe compressed (.gz, .zst, ...)")
    ids.add_argument("output", metavar="OUTPUT", help="Parquet file to write (replaced "
                     "atomically): INPUT's columns plus the id columns")
    add_input_options(ids)
    ids.add_argument("--layers", type=int, nargs="+", metavar="L",
                     help="PLE layers (0-based among the PLE layers; default 0); several give "
                     "one column each, named OUT_COLUMN_layerL")
    ids.add_argument("--scheme", choices=["qwen4exp", "engram"], default="qwen4exp",
                     help="hash family: qwen4exp (PLE, default) or engram (DeepSeek V4.1: all "
                     "layers, rows are whole sequences, needs --tokenizer tokenizer.json)")
    ids.add_argument("--out-column", help="id column name (default: ngram_ids; engram_ids)")
    ids.add_argument("--device", choices=["cpu", "gpu"], default="cpu",
                     help="where the ids are computed (default cpu; gpu needs CuPy and a device)")
    ids.add_argument("--compression", default="zstd",
                     help="Parquet compression (zstd, snappy, none, ...; default zstd)")
    ids.add_argument("--id-type", choices=["auto", "int32", "int64"], default="auto",
                     help="integer type of the ids (default auto: int32 when every row id of "
                     "the table fits, which halves the bytes; else int64)")
    ids.set_defaults(run=cmd_ids)
