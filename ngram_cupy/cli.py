"""The ``ngram-cupy`` command line: n-gram ids for token files, table layouts, hash statistics.

User mistakes (missing files, a wrong column, a bad config) print one line on stderr and exit
with status 2; an interrupted run exits with 130 (SIGINT) or 143 (SIGTERM) and leaves no output.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from .atomic import atomic_file
from .config import NGramConfig
from .formats import FORMATS
from .layout import LayerLayout, layer_layout

PROG = "ngram-cupy"
EXIT_USAGE = 2
EXIT_SIGINT = 130
EXIT_SIGTERM = 143
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
    return int(float(match.group(1)) * _BYTE_UNITS[match.group(2).lower()])


def load_config(path: str) -> NGramConfig:
    """The model config at ``path``; any problem with it is a ``UserError`` naming the file."""
    try:
        return NGramConfig.from_hf(path)
    except (ValueError, TypeError) as e:
        raise UserError(f"bad config {path}: {e}") from None


def layouts_for(config: NGramConfig, layers: list[int]) -> list[LayerLayout]:
    """The layouts of the chosen PLE layers."""
    try:
        return [layer_layout(config, layer) for layer in layers]
    except (ValueError, TypeError) as e:
        raise UserError(f"bad layer: {e}") from None


@dataclass
class TokenSource:
    """A Parquet file or dataset folder, or an Arrow IPC file or stream, read in record batches."""

    path: str
    schema: Any  # pyarrow.Schema
    num_rows: int | None  # None for an IPC stream
    batches: Callable[[], Iterator[Any]]  # fresh iterator of RecordBatches of bounded size
    # Every file read and its own schema (a folder's files may differ from one another).
    files: list[tuple[str, Any]] = field(default_factory=list)


def _slices(batches: Iterator[Any], rows: int) -> Iterator[Any]:
    """Zero-copy slices of at most ``rows`` rows of each batch."""
    for batch in batches:
        for start in range(0, batch.num_rows, rows):
            yield batch.slice(start, rows)


def open_tokens(path: str, batch_rows: int) -> TokenSource:
    """Open ``path`` for streaming; the kind is read from the file's magic bytes."""
    import pyarrow as pa
    import pyarrow.dataset as ds
    import pyarrow.parquet as pq

    if not os.path.exists(path):
        raise UserError(f"input not found: {path}")
    if not (os.path.isdir(path) or os.path.isfile(path)):
        raise UserError(f"input is not a regular file or folder (a FIFO or device cannot be "
                        f"read twice): {path}")
    if os.path.isdir(path):
        dataset = ds.dataset(path, format="parquet")
        files = [(f.path, f.physical_schema) for f in dataset.get_fragments()]
        if not files:
            raise UserError(f"no Parquet files in the input folder {path}")
        try:  # every file's columns, int32 tokens widened where another file has int64
            schema = pa.unify_schemas([s for _, s in files], promote_options="permissive")
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
            schema = dataset.schema  # check_files names the file that does not fit
        dataset = ds.dataset([f for f, _ in files], schema=schema, format="parquet")
        return TokenSource(path, schema, dataset.count_rows(),
                           lambda: dataset.to_batches(batch_size=batch_rows), files)
    with open(path, "rb") as f:
        magic = f.read(6)
    if magic.startswith(b"PAR1"):
        parquet = pq.ParquetFile(path)
        return TokenSource(path, parquet.schema_arrow, parquet.metadata.num_rows,
                           lambda: parquet.iter_batches(batch_size=batch_rows),
                           [(path, parquet.schema_arrow)])
    if magic == b"ARROW1":
        reader = pa.ipc.open_file(pa.memory_map(path))
        num_rows = sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))
        return TokenSource(
            path, reader.schema, num_rows,
            lambda: _slices((reader.get_batch(i) for i in range(reader.num_record_batches)),
                            batch_rows),
            [(path, reader.schema)],
        )
    try:
        schema = pa.ipc.open_stream(pa.memory_map(path)).schema
    except pa.ArrowInvalid:
        raise UserError(f"{path} is neither a Parquet nor an Arrow IPC file") from None
    return TokenSource(path, schema, None,
                       lambda: _slices(pa.ipc.open_stream(pa.memory_map(path)), batch_rows),
                       [(path, schema)])


def check_files(source: TokenSource, column: str, doc_id_column: str | None) -> None:
    """Every file of a folder must have the token (and document-id) column in a token type: a
    ``UserError`` naming the file, never a silent cast or a column of nulls."""
    from .arrow import check_input_schema

    if len(source.files) < 2:
        return
    for path, schema in source.files:
        try:
            check_input_schema(schema, column, doc_id_column)
        except (ValueError, TypeError) as e:
            raise UserError(f"{path}: {e}") from None


def check_output(output: str, inputs: list[str]) -> None:
    """Refuse, before anything is read or written, an OUTPUT that is a folder, lies in no folder,
    or is (through links, relative paths or a folder) one of the files read."""
    if os.path.isdir(output) or output.endswith(os.sep):
        raise UserError(f"output is a directory: {output}")
    if os.path.exists(output) and not os.path.isfile(output):
        raise UserError(f"output exists and is not a regular file (a device, FIFO or socket "
                        f"would be replaced): {output}")
    folder = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(folder):
        raise UserError(f"output folder does not exist: {folder}")
    real = os.path.realpath(output)
    for path in inputs:
        source = os.path.realpath(path)
        if os.path.isdir(source):
            if os.path.commonpath([source, real]) == source:
                raise UserError(f"OUTPUT {output} lies inside the INPUT folder {path}")
        elif real == source or (os.path.exists(output) and os.path.exists(path)
                                and os.path.samefile(output, path)):
            raise UserError(f"OUTPUT {output} is the INPUT file {path}")


def check_output_is_not_read(output: str, source: TokenSource) -> None:
    """OUTPUT must not be a hard link to a file of INPUT."""
    check_output(output, [path for path, _ in source.files])


@contextlib.contextmanager
def atomic_output(path: str) -> Iterator[str]:
    """A temporary path beside ``path``, renamed onto it on success and removed on any failure."""
    check_output(path, [])
    with atomic_file(path) as temporary:
        yield temporary


def token_count(batch: Any, column: str) -> int:
    """Tokens in a batch's list column, from its offsets."""
    offsets = batch.column(column).offsets
    return offsets[-1].as_py() - offsets[0].as_py() if len(offsets) else 0


def check_device(device: str) -> None:
    """``--device gpu`` needs CuPy and a visible CUDA device."""
    if device != "gpu":
        return
    try:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # no CuPy, no driver, no device: all the same answer here
        raise UserError(f"--device gpu: no usable CUDA device ({type(e).__name__}: {e})") from None
    if count == 0:
        raise UserError("--device gpu: no CUDA device found")


def progress_bar(total: int | None, quiet: bool, what: str):
    """A tqdm bar on stderr counting rows; off with ``--quiet`` and when stderr is not a TTY."""
    from tqdm import tqdm

    return tqdm(total=total, desc=what, unit=" rows", unit_scale=True, file=sys.stderr,
                disable=True if quiet else None, dynamic_ncols=True)


def cmd_ids(args: argparse.Namespace) -> int:
    """Stream INPUT through the id columns into OUTPUT (Parquet), atomically."""
    import pyarrow.parquet as pq

    from .arrow import NGramIds

    check_output(args.output, [args.input])
    layouts = layouts_for(load_config(args.config), args.layers)
    check_device(args.device)
    source = open_tokens(args.input, args.batch_rows)
    check_output_is_not_read(args.output, source)
    check_files(source, args.column, args.doc_id_column)
    mapper = NGramIds(layouts[0] if len(layouts) == 1 else layouts, args.column,
                      args.out_column, args.doc_id_column, args.device, reuse_buffers=True)
    schema = mapper.output_schema(source.schema)
    rows = tokens = 0
    start = time.perf_counter()
    with atomic_output(args.output) as tmp, progress_bar(source.num_rows, args.quiet,
                                                         "ids") as bar:
        # Hashed ids rarely repeat in a page and their min/max say nothing: no dictionary and no
        # statistics for the id columns, which saves time for nothing lost.
        with pq.ParquetWriter(tmp, schema, compression=args.compression,
                              use_dictionary=source.schema.names,
                              write_statistics=source.schema.names) as writer:
            for batch in source.batches():
                out = mapper(batch)
                writer.write_batch(out)
                rows += batch.num_rows
                tokens += token_count(batch, args.column)
                bar.update(batch.num_rows)
                elapsed = max(time.perf_counter() - start, 1e-9)
                bar.set_postfix_str(f"{bar.format_sizeof(tokens / elapsed)} tokens/s",
                                    refresh=False)
    elapsed = time.perf_counter() - start
    if not args.quiet:
        print(f"wrote {args.output}: {rows:,} rows, {tokens:,} tokens, {len(layouts)} layer(s) "
              f"in {elapsed:.2f} s ({tokens / max(elapsed, 1e-9) / 1e6:.1f} Mtokens/s)")
    return 0


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
    for fmt in FORMATS:
        nbytes = layout.table_nbytes(fmt.itemsize)
        lines.append(f"  {fmt.name:<14} {nbytes:>18,} B  {nbytes / (1 << 30):9.1f} GiB")
    return lines


def cmd_layout(args: argparse.Namespace) -> int:
    """Print one layer's hash layout and table sizes, and with budgets the placement plan."""
    from .placement import plan_placement

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
        plan = plan_placement(layouts_for(config, list(range(num_layers))),
                              args.gpu_budget or 0, args.host_budget or 0, dtype=dtype)
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


def cmd_stats(args: argparse.Namespace) -> int:
    """Print per-head hash statistics of INPUT (and plot the row loads)."""
    from .arrow import check_input_schema
    from .stats import ngram_stats, plot_load_histograms

    if args.plot is not None:
        check_output(args.plot, [args.input])
    (layout,) = layouts_for(load_config(args.config), [args.layer])
    source = open_tokens(args.input, args.batch_rows)
    check_files(source, args.column, args.doc_id_column)
    check_input_schema(source.schema, args.column, args.doc_id_column)
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UserError("--plot needs matplotlib: pip install matplotlib") from None
    with progress_bar(source.num_rows, args.quiet, "stats") as bar:
        def counted():
            for batch in source.batches():
                yield batch
                bar.update(batch.num_rows)

        stats, num_tokens = ngram_stats(counted(), layout, args.column, args.doc_id_column)
    print("\n".join(describe_stats(stats, num_tokens, layout)))
    if args.plot is not None:
        with atomic_output(args.plot) as tmp:
            plot_load_histograms(stats, tmp)
        print(f"wrote {args.plot}")
    return 0


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line on stderr (exit 2), like every user error."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {' '.join(message.split())}\n")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with the ``ids``, ``layout`` and ``stats`` commands."""
    parser = OneLineParser(
        prog=PROG, description="Exact hashed n-gram (PLE) ids, table layouts and hash statistics.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def common(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("--config", required=True,
                         help="model config.json (or a folder holding one)")
        sub.add_argument("--column", default="tokens", help="token column (default: tokens)")
        sub.add_argument("--doc-id-column", help="document-id column: consecutive rows with the "
                         "same id continue one document (default: every row is fresh)")
        sub.add_argument("--batch-rows", type=int, default=256,
                         help="rows per batch read (bounds memory; default 256)")
        sub.add_argument("--quiet", action="store_true", help="no progress bar or summary")

    ids = commands.add_parser("ids", help="write n-gram ids of a Parquet/Arrow token file",
                              description="Stream INPUT (Parquet file or folder, Arrow IPC) and "
                              "write it to OUTPUT (Parquet) with n-gram id columns.")
    ids.add_argument("input", metavar="INPUT")
    ids.add_argument("output", metavar="OUTPUT")
    common(ids)
    ids.add_argument("--layers", type=int, nargs="+", default=[0], metavar="L",
                     help="PLE layers (0-based among the PLE layers; default 0); several give "
                     "one column each, named OUT_COLUMN_layerL")
    ids.add_argument("--out-column", help="id column name (default: ngram_ids)")
    ids.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    ids.add_argument("--compression", default="zstd",
                     help="Parquet compression (zstd, snappy, none, ...; default zstd)")
    ids.set_defaults(run=cmd_ids)

    layout = commands.add_parser("layout", help="print a layer's hash layout and table sizes")
    layout.add_argument("--config", required=True, help="model config.json")
    layout.add_argument("--layer", type=int, default=0, help="PLE layer (default 0)")
    layout.add_argument("--gpu-budget", type=parse_bytes, metavar="BYTES",
                        help="GPU memory for tables (80GiB, 80G: binary; 80GB: decimal)")
    layout.add_argument("--host-budget", type=parse_bytes, metavar="BYTES",
                        help="pinned host memory for tables")
    layout.add_argument("--num-layers", type=int, metavar="N",
                        help="PLE layers to place (default: the config's ple_layer_ids, else 1)")
    layout.add_argument("--dtype", help="table storage dtype for the plan (default: the "
                        "config's ple_embedding_dtype)")
    layout.set_defaults(run=cmd_layout)

    stats = commands.add_parser("stats", help="per-head hash statistics of a token file")
    stats.add_argument("input", metavar="INPUT")
    common(stats)
    stats.add_argument("--layer", type=int, default=0, help="PLE layer (default 0)")
    stats.add_argument("--plot", metavar="PNG", help="also plot rows by load to this PNG")
    stats.set_defaults(run=cmd_stats)
    return parser


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean bad input rather than a bug: reported in one line."""
    errors: tuple[type[BaseException], ...] = (UserError, ValueError, TypeError, OSError)
    if "pyarrow" in sys.modules:
        errors += (sys.modules["pyarrow"].ArrowException,)
    return errors


def _terminate(signum: int, frame: Any) -> None:
    """SIGTERM unwinds like an exception, so temporary files are removed."""
    raise SystemExit(EXIT_SIGTERM)


def main(argv: list[str] | None = None) -> int:
    """Run one command; return its exit status."""
    args = build_parser().parse_args(argv)
    if getattr(args, "batch_rows", 1) < 1:
        print(f"{PROG}: error: --batch-rows must be at least 1", file=sys.stderr)
        return EXIT_USAGE
    try:
        previous = signal.signal(signal.SIGTERM, _terminate)
    except ValueError:  # not the main thread: leave SIGTERM alone
        previous = None
    try:
        return args.run(args)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return EXIT_SIGINT
    except _user_errors() as e:
        print(f"{PROG}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
