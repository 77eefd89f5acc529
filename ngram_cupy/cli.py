"""The ``ngram-cupy`` command line: n-gram ids of token or text files, table layouts, statistics.

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
from typing import Any

from .files.atomic import atomic_file
from .hashing.config import NGramConfig
from .hashing.layout import LayerLayout, layer_layout
from .runtime import interrupts
from .runtime.backends import gpu_available
from .tables.formats import FORMATS

PROG = "ngram-cupy"
DEFAULT_HOT_ROWS = (1_000, 10_000, 100_000, 1_000_000)  # as ngram_cupy.stats (not imported early)
DEFAULT_BATCH_TOKENS = (256, 4_096, 65_536)
EXIT_USAGE = 2
EXIT_SIGINT = 130
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
    """The layouts of the chosen PLE layers (no more than the config's ``ple_layer_ids`` name)."""
    count = len(config.ple_layer_ids) if config.ple_layer_ids is not None else None
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
    from .arrow import check_token_type
    from .ids.ids_numba import compile_kernels as compile_ids

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
    from .arrow import NGramIds, open_tokens, token_slices
    from .files.pipeline import tokens_per_call, write_ids, writer_options

    check_output(args.output, [args.input])
    layouts = layouts_for(load_config(args.config), args.layers)
    check_device(args.device)
    source = open_tokens(args.input, args.batch_rows)
    check_output_is_not_read(args.output, source)
    mapper = NGramIds(layouts[0] if len(layouts) == 1 else layouts, args.column,
                      args.out_column, args.doc_id_column, args.device,
                      id_type=args.id_type, **text_options(args))
    check_files(source, mapper)
    schema = mapper.output_schema(source.schema)
    compiled = 0.0
    if args.device == "cpu":
        compiled = compile_kernels(layouts, schema, args.column, args.quiet)
    rows = tokens = 0
    start = time.perf_counter()  # after compiling: the rate counts the work, not the compiler
    with atomic_output(args.output) as tmp, progress_bar(source.num_rows, args.quiet,
                                                         "ids") as bar:
        def progress(batch: Any) -> None:
            nonlocal rows, tokens
            interrupts.check()  # a signal swallowed while compiling still stops the run
            rows += batch.num_rows
            tokens += token_count(batch, args.column)
            bar.update(batch.num_rows)
            elapsed = max(time.perf_counter() - start, 1e-9)
            bar.set_postfix_str(f"{bar.format_sizeof(tokens / elapsed)} tokens/s", refresh=False)

        per_call = tokens_per_call(layouts[0].num_heads, mapper.id_dtype.itemsize)
        write_ids(token_slices(source.batches(), args.column, per_call), mapper, tmp, schema,
                  writer_options(schema, source.schema, args.compression), progress)
    elapsed = time.perf_counter() - start
    if not args.quiet:
        ready = f"; kernels compiled in {compiled:.1f} s before" if compiled >= 0.5 else ""
        print(f"wrote {args.output}: {rows:,} rows, {tokens:,} tokens, {len(layouts)} layer(s) "
              f"in {elapsed:.2f} s ({tokens / max(elapsed, 1e-9) / 1e6:.1f} Mtokens/s{ready})")
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
        row_bytes = fmt.row_bytes(layout.head_dim)  # block scales included (NVFP4)
        nbytes = layout.padded_rows * row_bytes
        lines.append(f"  {fmt.name:<14} {nbytes:>18,} B  {nbytes / (1 << 30):9.1f} GiB  "
                     f"({row_bytes} B per row)")
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

    from .arrow import NGramIds, check_input_schema, open_tokens
    from .stats import hottest_rows, ngram_stats, plot_stats, reuse_stats

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

    with progress_bar(source.num_rows, args.quiet, "collisions") as bar:
        stats, num_tokens = ngram_stats(tokenized(bar), layout, args.column, args.doc_id_column)
    with progress_bar(source.num_rows, args.quiet, "row reuse") as bar:
        reuse = reuse_stats(tokenized(bar), layout, args.column, args.doc_id_column,
                            args.hot_rows, args.batch_tokens)
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
    ids.add_argument("--id-type", choices=["auto", "int32", "int64"], default="auto",
                     help="integer type of the ids (default auto: int32 when every row id of "
                     "the table fits, which halves the bytes; else int64)")
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

    stats = commands.add_parser(
        "stats", help="hash collisions and held-out row reuse of a token or text file",
        description="Per head: distinct n-grams, rows touched, collisions. Held out (documents "
        "alternate between a profile and a measured part): the share of lookups the K hottest "
        "rows serve, distinct rows within batches, and rank-frequency slopes.")
    stats.add_argument("input", metavar="INPUT")
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
    return parser


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean bad input rather than a bug: reported in one line."""
    errors: tuple[type[BaseException], ...] = (UserError, ValueError, TypeError, OSError,
                                               ImportError)
    if "pyarrow" in sys.modules:
        errors += (sys.modules["pyarrow"].ArrowException,)
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
