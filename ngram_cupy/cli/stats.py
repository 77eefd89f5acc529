"""``ngram-cupy stats``: hash collisions and held-out row reuse of a token or text file."""

from __future__ import annotations

import argparse
import os

from ..hashing.layout import LayerLayout
from .common import (
    UserError,
    add_input_options,
    atomic_output,
    check_files,
    check_output,
    layouts_for,
    load_config,
    progress_bar,
    text_options,
)

DEFAULT_HOT_ROWS = (1_000, 10_000, 100_000, 1_000_000)  # as ngram_cupy.stats (not imported early)
DEFAULT_BATCH_TOKENS = (256, 4_096, 65_536)


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

    from ..arrow import NGramIds, check_input_schema
    from ..files.token_columns import TextError
    from ..files.token_files import open_tokens
    from ..stats import hottest_rows, ngram_stats, plot_stats, reuse_stats

    if args.plot is not None:
        check_output(args.plot, [args.input])
    (layout,) = layouts_for(load_config(args.config), [args.layer])
    source = open_tokens(args.input, args.batch_rows, args.text_column)
    mapper = NGramIds(layout, args.column, doc_id_column=args.doc_id_column,
                      **text_options(args, source))
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


def add_parser(commands) -> None:
    """Add the ``stats`` command to the sub-parsers ``commands``."""
    stats = commands.add_parser(
        "stats", help="hash collisions and held-out row reuse of a token or text file",
        description="Per head: distinct n-grams, rows touched, collisions. Held out (documents "
        "alternate between a profile and a measured part): the share of lookups the K hottest "
        "rows serve, distinct rows within batches, and rank-frequency slopes.")
    stats.add_argument("input", metavar="INPUT", help="Parquet file or folder, or an Arrow IPC "
                       "file or stream, with a token (or text) column; or plain text (.txt: "
                       "one document per line) or JSON Lines (.jsonl)")
    add_input_options(stats)
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
