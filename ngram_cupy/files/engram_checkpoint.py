"""Engram tables from a DeepSeek V4.1 checkpoint (docs/engram.md): one tensor per layer,
``layers.{l}.engram.embed.weight`` (``l`` the decoder layer) with its block ``.scale``, and
tensor-parallel ranks that own whole heads, i.e. contiguous rows."""

from __future__ import annotations

import os
from collections.abc import Sequence

from ..codecs.scales import block_scale_bits
from ..embedding import EngramEmbedding
from ..formats import BY_SAFETENSORS, ENGRAM, Format, checkpoint_formats, storage_format
from ..hashing.engram_layout import EngramLayout, check_engram_layout
from ..runtime.backends import HOST, unwrap_torch
from ..runtime.checks import check_integer
from ..tables.storage import TABLE_PLACEMENT, RowsSource, place, placement_named
from ..tables.table import EmbeddingTable
from .checkpoint_reading import shared_key
from .disk_blocks import disk_files
from .safetensors_files import Checkpoint, write_checkpoint

# The formats Engram checkpoints hold (``Format.checkpoints``): float tables by their dtype, and
# the block-scaled one (MXFP8) with its names.
FLOAT_TABLES = tuple(fmt.safetensors for fmt in checkpoint_formats(ENGRAM, blocked=False))
(MX,) = checkpoint_formats(ENGRAM, blocked=True)
NAMES = MX.checkpoint_names(ENGRAM)


def engram_head_rows(layout: EngramLayout, layer: int, rank: int,
                     world_size: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of Engram layer ``layer`` that rank slot ``rank`` of
    ``world_size`` owns: heads ``[rank * c, (rank + 1) * c)`` with ``c = ceil(H / world_size)``
    (none past the last head)."""
    heads = layout.num_heads
    per_rank = -(-heads // world_size)
    first, last = min(rank * per_rank, heads), min((rank + 1) * per_rank, heads)
    sizes = layout.head_sizes[layer]
    return int(sizes[:first].sum()), int(sizes[:last].sum())


def engram_tensor_name(names, layer_id: int, suffix: str = NAMES.rows) -> str | None:
    """The checkpoint's ``...layers.{layer_id}.engram.embed.{suffix}`` (any prefix), or None."""
    tail = f"layers.{layer_id}.engram.embed.{suffix}"
    found = [name for name in names if name == tail or name.endswith("." + tail)]
    if len(found) > 1:
        raise ValueError(f"several tensors end in {tail}: {sorted(found)}")
    return found[0] if found else None


def engram_table_format(checkpoint: Checkpoint, name: str, scales: str | None,
                        layout: EngramLayout, index: int) -> Format:
    """The checked format of Engram layer ``index``'s weight ``name`` (with its block scales
    ``scales``, or None): float32 / float16 / bfloat16, or MXFP8 (F8_E4M3 weight with an
    F8_E8M0 ``[rows, head_dim / 32]`` ``.scale``). Each ValueError names the tensor."""
    info = checkpoint.info(name)
    wanted = (layout.rows_per_layer[index], layout.head_dim)
    if info.shape != wanted:
        raise ValueError(f"{name} has shape {list(info.shape)}, the config needs "
                         f"{list(wanted)} (engram_num_embeddings, engram_head_dim)")
    if scales is None:
        if info.dtype == MX.safetensors:
            raise ValueError(f"{name} is {info.dtype} but its block scales "
                             f"{name.removesuffix(NAMES.rows)}{NAMES.block_scales} "
                             f"({MX.block_scale_safetensors}) "
                             f"are missing: an MXFP8 table needs them")
        if info.dtype not in FLOAT_TABLES:
            raise ValueError(f"{name} is {info.dtype}: this loader takes "
                             f"{', '.join(FLOAT_TABLES)} tables, or MXFP8 ({MX.safetensors} "
                             f"with a {MX.block_scale_safetensors} .scale)")
        return BY_SAFETENSORS[info.dtype]
    if info.dtype != MX.safetensors:
        raise ValueError(f"{name} is {info.dtype} with a block .scale ({scales}): an MXFP8 "
                         f"table's weight must be {MX.safetensors}")
    if layout.head_dim % MX.block:
        raise ValueError(f"{name}: MXFP8 tables need engram_head_dim a multiple of {MX.block}, "
                         f"got {layout.head_dim}")
    scale_info = checkpoint.info(scales)
    shape = (wanted[0], MX.scale_width(layout.head_dim))
    if scale_info.dtype != MX.block_scale_safetensors or scale_info.shape != shape:
        raise ValueError(f"{scales} must be {MX.block_scale_safetensors} of shape {list(shape)} "
                         f"(one scale byte per {MX.block} values), got {scale_info.dtype} of "
                         f"shape {list(scale_info.shape)}")
    return MX


def engram_rows(checkpoint: Checkpoint, layout: EngramLayout, index: int, name: str,
                scales: str | None, fmt: Format, start: int, stop: int) -> RowsSource:
    """Rows ``[start, stop)`` of Engram layer ``index``'s weight ``name`` (with its block
    ``scales``, or None), read or mapped from the checkpoint."""

    def blocks():
        yield (0, checkpoint.read(name, start, stop),
               None if scales is None else checkpoint.read(scales, start, stop))

    def mapped():
        block = (0, checkpoint.view(name)[start:stop])
        return [block if scales is None else (*block, checkpoint.view(scales)[start:stop])]

    key = shared_key(checkpoint, name, [name], index, start, stop, fmt.name)
    return RowsSource(stop - start, layout.head_dim, fmt, blocks, key, mapped,
                      checkpoint.check_mapped,
                      disk_files(checkpoint, [(name, scales, start, stop, 0)], fmt,
                                 layout.head_dim))


def load_engram_embedding(path: str | os.PathLike | Sequence[str | os.PathLike],
                          layout: EngramLayout, placement: str = TABLE_PLACEMENT, rank: int = 0,
                          world_size: int = 1) -> EngramEmbedding:
    """Every Engram layer's table from a safetensors checkpoint, as a ready ``EngramEmbedding``.

    ``path`` as for ``load_ngram_embedding``. Each weight must be ``[engram_num_embeddings,
    engram_head_dim]``: float32, float16 and bfloat16 tables load as they are, MXFP8 tables
    (F8_E4M3 with an F8_E8M0 ``.scale``, DeepSeek's layout) with their block scales (not
    ``placement="shared"``, which holds one array). ``placement="mmap"`` serves the rows
    straight from the mapped files. With ``world_size > 1`` only the rows of this rank's heads
    are read; the table answers zeros for the others.
    """
    check_engram_layout(layout)
    placed = placement_named(placement, mapped=True)
    world_size = check_integer("world_size", world_size, 1)
    rank = check_integer("rank", rank, 0)
    if rank >= world_size:
        raise ValueError(f"rank must lie in [0, world_size={world_size}), got {rank}")
    checkpoint = Checkpoint.open(path, random_access=placed.mapped)
    found = []
    for index, layer_id in enumerate(layout.layer_ids):  # every tensor checked before any read
        name = engram_tensor_name(checkpoint.tensors, layer_id)
        if name is None:
            raise ValueError(f"the checkpoint has no layers.{layer_id}.engram.embed.weight "
                             f"(Engram layer {index})")
        scales = engram_tensor_name(checkpoint.tensors, layer_id, NAMES.block_scales)
        fmt = engram_table_format(checkpoint, name, scales, layout, index)
        placed.check_holds(fmt, name)
        found.append((index, name, scales, fmt))
    tables = []
    for index, name, scales, fmt in found:
        start, stop = engram_head_rows(layout, index, rank, world_size)
        total = layout.rows_per_layer[index]
        source = engram_rows(checkpoint, layout, index, name, scales, fmt, start, stop)
        tables.append(EmbeddingTable(place(placement, source), row_start=start,
                                     total_rows=total))
    return EngramEmbedding(layout, tables)


def save_engram_embedding(path: str | os.PathLike, layout: EngramLayout, weights: Sequence,
                          block_scales: Sequence | None = None, prefix: str = "model.",
                          num_files: int = 1) -> list[str]:
    """Write every Engram layer's table in DeepSeek's names, atomically; return the files.

    ``weights[i]``: layer ``i``'s ``[engram_num_embeddings, engram_head_dim]`` rows (float32,
    float16, bfloat16, or E4M3 with ``block_scales[i]``, its UE8M0 ``[rows, head_dim / 32]``
    bytes: MXFP8), saved as ``{prefix}layers.{l}.engram.embed.weight`` and ``.scale``
    (F8_E8M0). ``path`` and ``num_files`` as for ``write_checkpoint``.
    """
    check_engram_layout(layout)
    if len(weights) != layout.num_layers or (
            block_scales is not None and len(block_scales) != layout.num_layers):
        raise ValueError(f"weights and block_scales need one table per Engram layer "
                         f"({layout.num_layers})")
    tensors = {}
    for index, layer_id in enumerate(layout.layer_ids):
        weight, torch_format = unwrap_torch(weights[index])
        weight = HOST.asarray(weight)
        if torch_format is not None:
            weight = weight.view(torch_format.dtype)
        wanted = (layout.rows_per_layer[index], layout.head_dim)
        if weight.shape != wanted:
            raise ValueError(f"weights[{index}] must have shape {list(wanted)}, got "
                             f"{list(weight.shape)}")
        name = f"{prefix}layers.{layer_id}.engram.embed."  # + the format's names
        if block_scales is None:
            fmt = storage_format(weight.dtype, f"weights[{index}]")
            if fmt.safetensors not in FLOAT_TABLES:
                raise ValueError(f"weights[{index}] is {fmt.name}: a float8 table needs its "
                                 f"block_scales (MXFP8)")
            tensors[name + NAMES.rows] = weight
            continue
        if weight.dtype != MX.dtype:
            raise ValueError(f"weights[{index}] must be {MX.dtype.name} with block_scales, got "
                             f"{weight.dtype}")
        MX.check_head_dim(layout.head_dim, "engram_head_dim")
        scales, scale_format = unwrap_torch(block_scales[index])
        bits = block_scale_bits(MX, HOST.asarray(scales), scale_format, wanted[0],
                                layout.head_dim)
        tensors[name + NAMES.rows] = weight
        tensors[name + NAMES.block_scales] = bits.view(MX.block_scale)
    return write_checkpoint(path, tensors, num_files)
