"""The ``ngram-cupy`` command line: n-gram ids of token or text files, table layouts, statistics,
and GPU kernels built ahead into the kernel cache.

User mistakes (missing files, a wrong column, a bad config) print one line on stderr and exit
with status 2; an interrupted run exits with 130 (SIGINT) or 143 (SIGTERM) and leaves no output.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import threading
import time
from collections.abc import Iterator
from fractions import Fraction
from typing import Any

from ..formats import FORMATS
from ..hashing.config import NGramConfig
from ..hashing.layout import LayerLayout, layer_layout
from ..runtime import interrupts
from ..runtime.atomic import atomic_file
from ..runtime.backends import gpu_available

PROG = "ngram-cupy"
DEFAULT_HOT_ROWS = (1_000, 10_000, 100_000, 1_000_000)  # as ngram_cupy.stats (not imported early)
DEFAULT_BATCH_TOKENS = (256, 4_096, 65_536)
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


def text_options(args: argparse.Namespace) -> dict[str, Any]:
    """``text_column`` and ``tokenizer`` keywords from ``--text-column`` and ``--tokenizer``."""
    if (args.text_column is None) != (args.tokenizer is None):
        raise UserError("--text-column and --tokenizer go together")
    return {"text_column": args.text_column, "tokenizer": args.tokenizer}


def compile_kernels(layouts: list[LayerLayout], schema: Any, column: str, quiet: bool) -> float:
    """Compile (or load from cache) the CPU id kernels for the input's types before the clock
    starts; on a terminal, say so when it takes long (a first run). Returns the seconds."""
    from ..arrow import check_token_type
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
    from ..arrow import (
        NGramIds,
        TextError,
        ids_metadata,
        open_tokens,
        out_of_vocabulary,
        token_slices,
    )
    from ..files.pipeline import tokens_per_call, write_ids, writer_options

    check_output(args.output, [args.input])
    layouts = layouts_for(load_config(args.config), args.layers or [0])
    check_device(args.device)
    source = open_tokens(args.input, args.batch_rows)
    check_output_is_not_read(args.output, source)
    mapper = NGramIds(layouts[0] if len(layouts) == 1 else layouts, args.column,
                      args.out_column, args.doc_id_column, args.device,
                      id_type=args.id_type, **text_options(args))
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
        print(f"wrote {args.output}: {rows:,} rows, {tokens:,} tokens, {len(layouts)} layer(s) "
              f"in {elapsed:.2f} s ({tokens / max(elapsed, 1e-9) / 1e6:.1f} Mtokens/s{ready})")
        if outside:
            print(f"note: {outside:,} token(s) lie outside the vocabulary [0, {vocab_size:,}) "
                  "(negative or too large); they are hashed as the model hashes them, but "
                  "usually mean a tokenizer that does not match the config")
    return 0


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


def cmd_engram_ids(args: argparse.Namespace) -> int:
    """``ids --scheme engram``: every row a whole sequence, ``[T, L, H]`` int32 ids per row."""
    from ..arrow import TextTokens, open_tokens
    from ..files.engram_parquet import EngramIds, write_engram_ids

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
    source = open_tokens(args.input, args.batch_rows)
    check_output_is_not_read(args.output, source)
    text = None if args.text_column is None else TextTokens(args.tokenizer, args.text_column,
                                                            args.column)
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

        write_engram_ids(source.batches(), mapper, tmp, source.schema, args.compression,
                         progress)
    if not args.quiet:
        elapsed = time.perf_counter() - start
        print(f"wrote {args.output}: {rows:,} rows, {tokens:,} tokens, Engram layers "
              f"{list(layout.layer_ids)} in {elapsed:.2f} s")
    return 0


def table_bytes_line(fmt, rows: int, head_dim: int) -> str:
    """One format's table bytes in memory (block scales included: a block-scaled row is one
    packed record, ``codecs.records``) and a row's bytes in memory and in a checkpoint, or why
    the format cannot hold the rows."""
    from ..codecs.records import record_bytes

    try:
        fmt.check_head_dim(head_dim)
    except ValueError:
        unit = max(fmt.pack, fmt.block)
        return f"  {fmt.name:<14} {'-':>18}    (head_dim {head_dim} is not a multiple of {unit})"
    in_memory = record_bytes(fmt, head_dim)
    nbytes = rows * in_memory
    return (f"  {fmt.name:<14} {nbytes:>18,} B  {nbytes / (1 << 30):9.1f} GiB  "
            f"({in_memory} B per row in memory, {fmt.row_bytes(head_dim)} B in a checkpoint)")


def describe_engram_layout(config, layout) -> list[str]:
    """The Engram hash parameters, every layer's multipliers, head sizes and table bytes."""
    from ..hashing.engram_layout import engram_multipliers

    multipliers = engram_multipliers(config.engram_layer_ids, config.engram_max_ngram_size,
                                     config.engram_compressed_vocab_size)
    pad = ("pad id: pass --tokenizer" if layout is None else
           f"pad token {config.engram_pad_token_id} -> compressed id {layout.pad_id}")
    lines = [f"Engram layers {list(config.engram_layer_ids)}: compressed vocab "
             f"{config.engram_compressed_vocab_size:,}, orders 2..{config.engram_max_ngram_size}"
             f" x {config.engram_n_heads} heads = {config.num_heads} heads per layer; {pad}"]
    for index, (layer_id, sizes) in enumerate(zip(config.engram_layer_ids, config.head_sizes(),
                                                  strict=True)):
        rows = config.engram_num_embeddings[index]
        lines += [f"layer {layer_id} (Engram layer {index}): multipliers "
                  + " ".join(str(int(m)) for m in multipliers[index]),
                  f"{'head':>4} {'order':>5} {'size':>15} {'offset':>15}"]
        offset = 0
        for h, size in enumerate(sizes):
            lines.append(f"{h:>4} {h // config.engram_n_heads + 2:>5} {size:>15,} {offset:>15,}")
            offset += size
        lines.append(f"rows {rows:,} ({offset:,} hashed); head_dim {config.engram_head_dim}; "
                     f"table bytes:")
        lines += [table_bytes_line(fmt, rows, config.engram_head_dim) for fmt in FORMATS]
    return lines


def describe_layout(layout: LayerLayout) -> list[str]:
    """Human-readable lines: the hash parameters, every head's size and offset, table bytes."""
    config = layout.config
    lines = [
        f"layer {layout.layer}: vocab {config.vocab_size:,}, eos {config.eos_token_id}, "
        f"orders 2..{config.ngram_size} x {config.heads_per_ngram} heads = {layout.num_heads} "
        f"heads, seed {config.seed}",
        "multipliers " + " ".join(str(int(m)) for m in layout.multipliers),
        f"{'head':>4} {'order':>5} {'size':>15} {'offset':>15}",
    ]
    for h, (size, offset) in enumerate(zip(layout.head_sizes, layout.head_offsets, strict=True)):
        order = h // config.heads_per_ngram + 2
        lines.append(f"{h:>4} {order:>5} {int(size):>15,} {int(offset):>15,}")
    shard = -(-layout.padded_rows // config.split_ngram_parts)
    lines.append(f"rows {layout.num_rows:,}, padded to {layout.padded_rows:,} "
                 f"(a multiple of {config.make_ngram_vocab_size_divisible_by}); "
                 f"{config.split_ngram_parts} shards of {shard:,} rows")
    if layout.head_dim is None:
        lines.append("table bytes: unknown (the config has no ple_embed_dim)")
        return lines
    lines.append(f"head_dim {layout.head_dim} ({config.embedding_dim} / {layout.num_heads} heads); "
                 f"table bytes per layer:")
    lines += [table_bytes_line(fmt, layout.padded_rows, layout.head_dim) for fmt in FORMATS]
    return lines


def cmd_layout(args: argparse.Namespace) -> int:
    """Print one layer's hash layout and table sizes, and with budgets the placement plan."""
    if args.scheme == "engram":
        print("\n".join(describe_engram_layout(*load_engram(args, need_tokenizer=False))))
        return 0
    from ..tables.plan import plan_placement

    config = load_config(args.config)
    (layout,) = layouts_for(config, [args.layer])
    lines = describe_layout(layout)
    if args.gpu_budget is not None or args.host_budget is not None:
        num_layers = len(config.ple_layer_ids or [0]) if args.num_layers is None \
            else args.num_layers
        if num_layers < 1:
            raise UserError(f"--num-layers must be at least 1, got {num_layers}")
        dtype = args.dtype or config.ple_embedding_dtype
        if dtype is None:
            raise UserError("a placement plan needs the table dtype: pass --dtype or set "
                            "ple_embedding_dtype in the config")
        if args.processes_per_node < 1:
            raise UserError(f"--processes-per-node must be at least 1, got "
                            f"{args.processes_per_node}")
        plan = plan_placement(layouts_for(config, list(range(num_layers))),
                              args.gpu_budget or 0, args.host_budget or 0, dtype=dtype,
                              processes_per_node=args.processes_per_node)
        lines += [f"placement of {num_layers} layer table(s) as {dtype}, in layer order:",
                  plan.summary()]
    print("\n".join(lines))
    return 0


def describe_stats(stats, num_tokens: int, layout: LayerLayout) -> list[str]:
    """The per-head statistics table and the row-load histogram of each order."""
    lines = [
        f"layer {layout.layer}, {num_tokens:,} tokens",
        f"{'head':>4} {'order':>5} {'size':>12} {'distinct':>10} {'rows':>10} "
        f"{'colliding':>10} {'uniform':>8} {'max load':>8}",
    ]
    for s in stats:
        lines.append(f"{s.head:>4} {s.order:>5} {s.size:>12,} {s.distinct_ngrams:>10,} "
                     f"{s.rows_touched:>10,} {s.collision_share:>10.3%} {s.uniform_share:>8.3%} "
                     f"{s.load_histogram.size - 1:>8}")
    lines.append("distinct: distinct n-grams of the head's order; rows: table rows they touch; "
                 "colliding: share of them sharing a row; uniform: that share under ideal hashing")
    lines.append("rows by load (distinct n-grams per touched row), summed over each order's heads:")
    for order in sorted({s.order for s in stats}):
        totals: dict[int, int] = {}
        for s in stats:
            if s.order == order:
                for load in range(1, s.load_histogram.size):
                    totals[load] = totals.get(load, 0) + int(s.load_histogram[load])
        cells = ", ".join(f"{load}: {count:,}" for load, count in sorted(totals.items()) if count)
        lines.append(f"  order {order}: {cells or 'none'}")
    return lines


def describe_reuse(reuse) -> list[str]:
    """The held-out hit rates of the hottest rows, distinct rows per batch and slopes."""
    layout = reuse.layout
    lines = [
        f"row reuse, layer {layout.layer}, held out: documents alternate between the profile "
        f"({reuse.profile_tokens:,} tokens) and the measured part ({reuse.measured_tokens:,} "
        f"tokens, {reuse.measured.lookups:,} lookups)",
        f"{'hot rows K':>12} {'of table':>9} {'served':>8}   (share of measured lookups that "
        f"the profile's K most looked-up rows serve)",
    ]
    for k, share in zip(reuse.hot_rows, reuse.hit_rates, strict=True):
        lines.append(f"{int(k):>12,} {k / layout.padded_rows:>9.4%} {share:>8.2%}")
    cells = ", ".join(f"{b:,} tokens: {share:.1%}" for b, share in
                      zip(reuse.batch_tokens, reuse.distinct_shares, strict=True))
    lines.append(f"distinct rows per lookup within measured batches of {cells}")
    lines.append("rank-frequency slope of measured row lookups (log-log, rows seen twice or more): "
                 + ", ".join(f"{g}-grams {slope:.2f}" for g, slope in reuse.slopes.items()))
    return lines


def cmd_stats(args: argparse.Namespace) -> int:
    """Print hash statistics and held-out row reuse of INPUT (and plot them)."""
    import numpy as np

    from ..arrow import NGramIds, TextError, check_input_schema, open_tokens
    from ..stats import hottest_rows, ngram_stats, plot_stats, reuse_stats

    if args.plot is not None:
        check_output(args.plot, [args.input])
    (layout,) = layouts_for(load_config(args.config), [args.layer])
    source = open_tokens(args.input, args.batch_rows)
    mapper = NGramIds(layout, args.column, doc_id_column=args.doc_id_column,
                      **text_options(args))
    check_files(source, mapper)
    schema = mapper.output_schema(source.schema)
    check_input_schema(schema, args.column, args.doc_id_column)
    if any(k < 0 for k in args.hot_rows) or any(b < 1 for b in args.batch_tokens):
        raise UserError("--hot-rows must be non-negative and --batch-tokens positive")
    save_k, save_path = None, None
    if args.save_hot_rows is not None:
        save_k, save_path = args.save_hot_rows
        try:
            save_k = int(save_k)
        except ValueError:
            raise UserError(f"--save-hot-rows K PATH: K must be an integer, got {save_k!r}") \
                from None
        if save_k < 1:
            raise UserError(f"--save-hot-rows K PATH: K must be positive, got {save_k}")
        check_output(save_path, [args.input])
        if args.plot is not None and os.path.realpath(args.plot) == os.path.realpath(save_path):
            raise UserError(f"--plot and --save-hot-rows name the same file {save_path}: one "
                            f"would replace the other")
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UserError("--plot needs matplotlib: pip install matplotlib") from None

    def tokenized(bar):
        """INPUT's batches with their token column (tokenized from text if asked)."""
        for batch in source.batches():
            yield batch if mapper.text is None else mapper.text(batch)
            bar.update(batch.num_rows)

    try:
        with progress_bar(source.num_rows, args.quiet, "collisions") as bar:
            stats, num_tokens = ngram_stats(tokenized(bar), layout, args.column,
                                            args.doc_id_column)
        with progress_bar(source.num_rows, args.quiet, "row reuse") as bar:
            reuse = reuse_stats(tokenized(bar), layout, args.column, args.doc_id_column,
                                args.hot_rows, args.batch_tokens)
    except TextError as e:
        raise UserError(f"{args.input}: {e}") from None
    print("\n".join(describe_stats(stats, num_tokens, layout) + describe_reuse(reuse)))
    if save_path is not None:
        rows = hottest_rows(reuse.all_counts(), save_k)
        with atomic_output(save_path) as tmp, open(tmp, "wb") as f:
            np.save(f, rows)
        print(f"wrote {save_path}: the {rows.size:,} most looked-up rows of layer {layout.layer} "
              f"(all documents), sorted int64")
    if args.plot is not None:
        with atomic_output(args.plot) as tmp:
            plot_stats(stats, reuse, tmp)
        print(f"wrote {args.plot}")
    return 0


def describe_backend() -> list[str]:
    """The library's version and the backends a run would use: CPU threads and Numba's
    threading layer, CuPy and the GPU (or none), the kernel cache folder."""
    import numba
    import numpy as np

    from .._version import package_version
    from ..runtime.cpu_threads import threading_layer

    lines = [f"{PROG} {package_version()} (Python {sys.version.split()[0]}, "
             f"NumPy {np.__version__}, Numba {numba.__version__})",
             f"CPU: {numba.get_num_threads()} threads of {os.cpu_count()} cores, Numba threading "
             f"layer {threading_layer()}"]
    try:
        import cupy
    except ImportError:
        lines.append("GPU: none (CuPy is not installed: the cuda12 or cuda13 extra)")
    else:
        if gpu_available():
            name = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
            lines.append(f"GPU: {name} ({cupy.cuda.runtime.getDeviceCount()} device(s)), CuPy "
                         f"{cupy.__version__}")
        else:
            lines.append(f"GPU: none (CuPy {cupy.__version__} sees no usable CUDA device)")
    from ..runtime.kernel_cache import CACHE_ENV, cache_dir

    cache = cache_dir()
    where = "set by " + CACHE_ENV if os.environ.get(CACHE_ENV) else "default; set " + CACHE_ENV
    lines.append(f"kernel cache folder: {cache} ({where})")
    return lines


def cmd_info(args: argparse.Namespace) -> int:
    """Print the version and the backends in use."""
    print("\n".join(describe_backend()))
    return 0


def parse_arches(text: str) -> list[tuple[int, int]]:
    """Compute capabilities from ``sm_80,sm_90`` (``sm_XY``: major X, minor Y)."""
    arches = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*sm_(\d+)(\d)\s*", part)
        if not match:
            raise argparse.ArgumentTypeError(
                f"not a GPU architecture: {part!r} (examples: sm_80, sm_90, sm_80,sm_90)")
        arches.append((int(match.group(1)), int(match.group(2))))
    return list(dict.fromkeys(arches))


def load_schemes(names: list[str]) -> list:
    """The schemes named (``released``) or read from model config files."""
    from ..ids.kernel_set import SCHEMES, scheme_from_config

    schemes = []
    for name in names:
        if name in SCHEMES:
            schemes.append(SCHEMES[name])
        elif os.path.exists(name):
            try:
                schemes.append(scheme_from_config(name))
            except (ValueError, TypeError) as e:
                raise UserError(f"bad config {name}: {e}") from None
        else:
            raise UserError(f"--scheme {name}: neither a scheme ({', '.join(SCHEMES)}) nor a "
                            f"model config file")
    return schemes


def build_variant(names: tuple[str, ...], only: str | None, index: int,
                  cc: tuple[int, int]) -> tuple[int, bool, float]:
    """Build variant ``index`` of the schemes ``names`` for ``cc`` into the kernel cache (in
    this process or a worker); ``(index, whether it was compiled, seconds)``."""
    from ..runtime import kernel_cache

    variant = selected_variants(names, only)[index]
    builds, start = kernel_cache.KERNELS.builds, time.perf_counter()
    variant.build(cc)
    return index, kernel_cache.KERNELS.builds > builds, time.perf_counter() - start


def selected_variants(names: tuple[str, ...], only: str | None) -> list:
    """The kernel variants of the schemes ``names`` whose name contains ``only``."""
    from ..ids.kernel_set import kernel_variants

    return [v for v in kernel_variants(load_schemes(list(names)))
            if only is None or only in v.name]


def is_cached(variant, cc: tuple[int, int]) -> bool:
    """Whether ``variant`` for ``cc`` loads from the kernel cache (inside ``loads_only``)."""
    from ..runtime.kernel_cache import NotCached

    try:
        variant.build(cc)
    except NotCached:
        return False
    return True


def cmd_compile(args: argparse.Namespace) -> int:
    """Build every GPU kernel of the schemes for the architectures into the kernel cache."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    from ..runtime import kernel_cache

    names = tuple(args.scheme)
    variants = selected_variants(names, args.only)
    if not variants:
        raise UserError(f"--only {args.only!r} matches no kernel")
    if args.list:
        print("\n".join(variant.name for variant in variants))
        return 0
    if args.jobs < 1:
        raise UserError(f"--jobs must be at least 1, got {args.jobs}")
    jobs = [(names, args.only, index, cc) for cc in args.arch for index in range(len(variants))]
    start = time.perf_counter()
    built = 0

    def report(job, result) -> None:
        nonlocal built
        index, compiled, seconds = result
        built += compiled
        if not args.quiet:
            print(f"sm_{job[3][0]}{job[3][1]} {variants[index].name}: "
                  f"{'compiled' if compiled else 'cached'} in {seconds:.2f} s", flush=True)

    missing = []
    with kernel_cache.KERNELS.loads_only():  # what is cached already: no workers for those
        for job in jobs:
            begin = time.perf_counter()
            if is_cached(variants[job[2]], job[3]):
                report(job, (job[2], False, time.perf_counter() - begin))
            else:
                missing.append(job)
    if args.jobs == 1 or len(missing) <= 1:
        for job in missing:
            interrupts.check()
            report(job, build_variant(*job))
    else:
        # spawn: a forked Numba/LLVM is not safe to compile in
        with ProcessPoolExecutor(min(args.jobs, len(missing)),
                                 mp_context=get_context("spawn")) as pool:
            for job, result in zip(missing, pool.map(build_variant, *zip(*missing, strict=True)),
                                   strict=True):
                report(job, result)
    arches = ", ".join(f"sm_{major}{minor}" for major, minor in args.arch)
    print(f"{len(jobs)} kernel builds for {arches}: {built} compiled, {len(jobs) - built} "
          f"cached, in {time.perf_counter() - start:.1f} s (cache: {kernel_cache.cache_dir()})")
    return 0


def cmd_quantize(args: argparse.Namespace) -> int:
    """``quantize``: a model's n-gram tables to fp8, NVFP4 or MXFP8, in a new checkpoint."""
    from ..files.quantize_checkpoint import quantize_checkpoint

    start = time.perf_counter()
    quantize_checkpoint(args.model, args.to, args.output, args.layers, args.scheme,
                        progress=False if args.quiet else None)
    if not args.quiet:
        print(f"wrote {args.output}: {args.to} tables in {time.perf_counter() - start:.2f} s")
    return 0


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line on stderr (exit 2), like every user error."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {' '.join(message.split())}\n")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with the ``ids``, ``layout``, ``stats``, ``compile`` and ``info``
    commands."""
    from .._version import package_version

    parser = OneLineParser(
        prog=PROG, description="Exact hashed n-gram (PLE) ids, table layouts and hash statistics.")
    parser.add_argument("--version", action="version", version=f"{PROG} {package_version()}",
                        help="print the version and exit (`ngram-cupy info`: the backends too)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def common(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("--config", required=True,
                         help="model config.json (or a folder holding one)")
        sub.add_argument("--column", default="tokens", help="token column (default: tokens); "
                         "with --text-column, the name of the token column written")
        sub.add_argument("--text-column", metavar="NAME",
                         help="tokenize this text column (string) first, with --tokenizer")
        sub.add_argument("--tokenizer", metavar="SPEC",
                         help="qwen3.5 (alias qwen3.6: the released model's tokenizer) or a path "
                         "to a tokenizer.json (needs the text extra)")
        sub.add_argument("--doc-id-column", help="document-id column: consecutive rows with the "
                         "same id continue one document (default: every row is fresh)")
        sub.add_argument("--batch-rows", type=int, default=256,
                         help="rows per batch read (bounds memory; default 256)")
        sub.add_argument("--quiet", action="store_true", help="no progress bar or summary")

    ids = commands.add_parser("ids", help="write n-gram ids of a Parquet/Arrow token file",
                              description="Stream INPUT (Parquet file or folder, Arrow IPC) and "
                              "write it to OUTPUT (Parquet) with n-gram id columns.")
    ids.add_argument("input", metavar="INPUT", help="Parquet file or folder of Parquet files, or "
                     "an Arrow IPC file or stream, with a token (or text) column")
    ids.add_argument("output", metavar="OUTPUT", help="Parquet file to write (replaced "
                     "atomically): INPUT's columns plus the id columns")
    common(ids)
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

    layout = commands.add_parser("layout", help="print a layer's hash layout and table sizes")
    layout.add_argument("--config", required=True, help="model config.json")
    layout.add_argument("--layer", type=int, default=0, help="PLE layer (default 0)")
    layout.add_argument("--scheme", choices=["qwen4exp", "engram"], default="qwen4exp",
                        help="hash family (engram: every Engram layer of the config)")
    layout.add_argument("--tokenizer", metavar="PATH", help="--scheme engram: the model's "
                        "tokenizer.json, for the pad id and a check of the compressed vocab")
    layout.add_argument("--gpu-budget", type=parse_bytes, metavar="BYTES",
                        help="GPU memory for tables (80GiB, 80G: binary; 80GB: decimal)")
    layout.add_argument("--host-budget", type=parse_bytes, metavar="BYTES",
                        help="pinned host memory for tables")
    layout.add_argument("--num-layers", type=int, metavar="N",
                        help="PLE layers to place (default: the config's ple_layer_ids, else 1)")
    layout.add_argument("--dtype", help="table storage dtype for the plan (default: the "
                        "config's ple_embedding_dtype)")
    layout.add_argument("--processes-per-node", type=int, default=1, metavar="N",
                        help="processes of a node holding the tables: above 1, host tables are "
                        "one shared copy (placement 'shared') in the node's --host-budget")
    layout.set_defaults(run=cmd_layout)

    stats = commands.add_parser(
        "stats", help="hash collisions and held-out row reuse of a token or text file",
        description="Per head: distinct n-grams, rows touched, collisions. Held out (documents "
        "alternate between a profile and a measured part): the share of lookups the K hottest "
        "rows serve, distinct rows within batches, and rank-frequency slopes.")
    stats.add_argument("input", metavar="INPUT", help="Parquet file or folder, or an Arrow IPC "
                       "file or stream, with a token (or text) column")
    common(stats)
    stats.add_argument("--layer", type=int, default=0, help="PLE layer (default 0)")
    stats.add_argument("--hot-rows", type=int, nargs="+", metavar="K",
                       default=list(DEFAULT_HOT_ROWS),
                       help="ladder of hot-row counts K (default: 1000 10000 100000 1000000)")
    stats.add_argument("--batch-tokens", type=int, nargs="+", metavar="B",
                       default=list(DEFAULT_BATCH_TOKENS),
                       help="batch sizes for the distinct-row share (default: 256 4096 65536)")
    stats.add_argument("--save-hot-rows", nargs=2, metavar=("K", "PATH"),
                       help="write the K most looked-up rows of the layer as a sorted int64 .npy "
                       "(the hot-row tier's input)")
    stats.add_argument("--plot", metavar="PNG", help="also plot row loads, hot-row hit rates "
                       "and rank-frequency curves to this PNG")
    stats.set_defaults(run=cmd_stats)

    build = commands.add_parser(
        "compile", help="build the GPU kernels into the kernel cache ahead of time (no GPU "
        "needed)", description="Compile every GPU kernel the library launches for the schemes "
        "(model shapes) and architectures into the kernel cache (NGRAM_CUPY_CACHE_DIR), so "
        "that a process's first GPU call loads them instead of compiling.")
    build.add_argument("--arch", type=parse_arches, default=[(8, 0), (9, 0)],
                       metavar="sm_XY[,sm_XY...]", help="GPU architectures (default sm_80,sm_90)")
    build.add_argument("--scheme", nargs="+", default=["released"], metavar="SCHEME",
                       help="model shapes: 'released' (the released model) or model config "
                       "files (default: released)")
    build.add_argument("--only", metavar="TEXT", help="only the kernels whose name contains TEXT")
    build.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1),
                       help="compiler processes (default: the CPUs, at most 8)")
    build.add_argument("--quiet", action="store_true", help="only the summary line")
    build.add_argument("--list", action="store_true",
                       help="print the names of the kernels selected, one a line, and build none")
    build.set_defaults(run=cmd_compile)
    quantize = commands.add_parser(
        "quantize", help="quantise a model's n-gram tables to fp8, nvfp4 or mxfp8",
        description="Write MODEL (a folder with config.json and safetensors) into the new "
        "folder OUTPUT with its float n-gram tables quantised, in the engine's names.")
    quantize.add_argument("model", metavar="MODEL_OR_CHECKPOINT", help="model folder")
    quantize.add_argument("--to", required=True, choices=["fp8", "nvfp4", "mxfp8"],
                          help="format: fp8 or nvfp4 (Qwen4Exp), mxfp8 (Engram)")
    quantize.add_argument("output", metavar="OUTPUT", help="new folder to write (must not "
                          "exist; appears complete or not at all)")
    quantize.add_argument("--layers", type=int, nargs="+", metavar="L",
                          help="PLE (or Engram) layers, 0-based (default: all)")
    quantize.add_argument("--scheme", choices=["qwen4exp", "engram"], default="qwen4exp",
                          help="model family (default qwen4exp)")
    quantize.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    quantize.set_defaults(run=cmd_quantize)
    info = commands.add_parser("info", help="print the version and the backends in use",
                               description="The version, CPU threads and Numba's threading "
                               "layer, CuPy and the GPU (or none), and the kernel cache folder.")
    info.set_defaults(run=cmd_info)
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
    args = build_parser().parse_args(argv)
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
