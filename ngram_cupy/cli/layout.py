"""``ngram-cupy layout``: a layer's hash layout and table sizes, and a placement plan."""

from __future__ import annotations

import argparse

from ..formats import FORMATS
from ..hashing.layout import LayerLayout
from .common import UserError, layouts_for, load_config, load_engram, parse_bytes


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


# The placement plan's options: refused without a budget, or with --scheme engram.
PLAN_OPTIONS = (("num_layers", "--num-layers"), ("dtype", "--dtype"),
                ("processes_per_node", "--processes-per-node"))


def refuse_unused(args: argparse.Namespace) -> None:
    """A ``UserError`` for an option this scheme (or a layout without budgets) would ignore."""
    budgets = args.gpu_budget is not None or args.host_budget is not None
    if args.scheme == "engram":
        if args.layer is not None:
            raise UserError("--layer is not supported with --scheme engram (it lists every "
                            "Engram layer of the config)")
        if budgets:
            flag = "--gpu-budget" if args.gpu_budget is not None else "--host-budget"
            raise UserError(f"{flag} is not supported with --scheme engram (placement plans are "
                            f"for qwen4exp PLE tables)")
    elif args.tokenizer is not None:
        raise UserError("--tokenizer is only for --scheme engram (a qwen4exp layout needs none)")
    for name, flag in PLAN_OPTIONS:
        if getattr(args, name) is not None and not budgets:
            raise UserError(f"{flag} is only for a placement plan: pass --gpu-budget or "
                            f"--host-budget (not supported with --scheme engram)")


def cmd_layout(args: argparse.Namespace) -> int:
    """Print one layer's hash layout and table sizes, and with budgets the placement plan."""
    refuse_unused(args)
    if args.scheme == "engram":
        print("\n".join(describe_engram_layout(*load_engram(args, need_tokenizer=False))))
        return 0
    from ..tables.plan import plan_placement

    config = load_config(args.config)
    (layout,) = layouts_for(config, [args.layer or 0])
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
        processes = 1 if args.processes_per_node is None else args.processes_per_node
        if processes < 1:
            raise UserError(f"--processes-per-node must be at least 1, got {processes}")
        plan = plan_placement(layouts_for(config, list(range(num_layers))),
                              args.gpu_budget or 0, args.host_budget or 0, dtype=dtype,
                              processes_per_node=processes)
        lines += [f"placement of {num_layers} layer table(s) as {dtype}, in layer order:",
                  plan.summary()]
    print("\n".join(lines))
    return 0


def add_parser(commands) -> None:
    """Add the ``layout`` command to the sub-parsers ``commands``."""
    layout = commands.add_parser("layout", help="print a layer's hash layout and table sizes")
    layout.add_argument("--config", required=True, help="model config.json")
    layout.add_argument("--layer", type=int, help="PLE layer (default 0; qwen4exp only)")
    layout.add_argument("--scheme", choices=["qwen4exp", "engram"], default="qwen4exp",
                        help="hash family (engram: every Engram layer of the config)")
    layout.add_argument("--tokenizer", metavar="PATH", help="--scheme engram: the model's "
                        "tokenizer.json, for the pad id and a check of the compressed vocab")
    layout.add_argument("--gpu-budget", type=parse_bytes, metavar="BYTES",
                        help="GPU memory for tables (80GiB, 80G: binary; 80GB: decimal); "
                        "with --host-budget, a placement plan (qwen4exp only)")
    layout.add_argument("--host-budget", type=parse_bytes, metavar="BYTES",
                        help="pinned host memory for tables")
    layout.add_argument("--num-layers", type=int, metavar="N",
                        help="PLE layers to place (default: the config's ple_layer_ids, else 1)")
    layout.add_argument("--dtype", help="table storage dtype for the plan (default: the "
                        "config's ple_embedding_dtype)")
    layout.add_argument("--processes-per-node", type=int, metavar="N",
                        help="processes of a node holding the tables (default 1): above 1, host "
                        "tables are one shared copy (placement 'shared') in the node's "
                        "--host-budget")
    layout.set_defaults(run=cmd_layout)
