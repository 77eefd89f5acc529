"""Engram tables from a DeepSeek V4.1 checkpoint (SPEC section 11): one tensor per layer,
``layers.{l}.engram.embed.weight`` (``l`` the decoder layer) with its block ``.scale``, and
tensor-parallel ranks that own whole heads, i.e. contiguous rows."""

from __future__ import annotations

import os
from collections.abc import Sequence

from ..embedding import EngramEmbedding
from ..hashing.engram_layout import EngramLayout, check_engram_layout
from ..runtime.checks import check_integer
from ..tables.formats import FORMATS
from ..tables.formats import MXFP8 as MXFP8_CODE
from ..tables.table import EmbeddingTable
from .safetensors_files import DTYPES, Checkpoint

PLACEMENTS = ("cpu", "gpu", "pinned", "host")
FLOAT_TABLES = ("F32", "F16", "BF16")
MXFP8 = FORMATS[MXFP8_CODE]


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


def engram_tensor_name(names, layer_id: int, suffix: str = "weight") -> str | None:
    """The checkpoint's ``...layers.{layer_id}.engram.embed.{suffix}`` (any prefix), or None."""
    tail = f"layers.{layer_id}.engram.embed.{suffix}"
    found = [name for name in names if name == tail or name.endswith("." + tail)]
    if len(found) > 1:
        raise ValueError(f"several tensors end in {tail}: {sorted(found)}")
    return found[0] if found else None


def load_engram_embedding(path: str | os.PathLike | Sequence[str | os.PathLike],
                          layout: EngramLayout, placement: str = "cpu", rank: int = 0,
                          world_size: int = 1) -> EngramEmbedding:
    """Every Engram layer's table from a safetensors checkpoint, as a ready ``EngramEmbedding``.

    ``path`` as for ``load_ngram_embedding``. Each weight must be ``[engram_num_embeddings,
    engram_head_dim]``; float32, float16 and bfloat16 tables load as they are, MXFP8 tables
    (F8_E4M3 with an F8_E8M0 or U8 ``.scale`` of ``[rows, head_dim / 32]``) as ``"mxfp8"``
    tables. With ``world_size > 1`` only the rows of this rank's heads are read; the table
    answers zeros for the others.
    """
    check_engram_layout(layout)
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
    world_size = check_integer("world_size", world_size, 1)
    rank = check_integer("rank", rank, 0)
    if rank >= world_size:
        raise ValueError(f"rank must lie in [0, world_size={world_size}), got {rank}")
    checkpoint = Checkpoint.open(path)
    names = {}
    for index, layer_id in enumerate(layout.layer_ids):  # every tensor checked before any read
        name = engram_tensor_name(checkpoint.tensors, layer_id)
        if name is None:
            raise ValueError(f"the checkpoint has no layers.{layer_id}.engram.embed.weight "
                             f"(Engram layer {index})")
        info = checkpoint.info(name)
        wanted = (layout.rows_per_layer[index], layout.head_dim)
        if info.shape != wanted:
            raise ValueError(f"{name} has shape {list(info.shape)}, the config needs "
                             f"{list(wanted)} (engram_num_embeddings, engram_head_dim)")
        scales = engram_tensor_name(checkpoint.tensors, layer_id, "scale")
        if info.dtype == MXFP8.safetensors and scales is not None:
            _check_block_scales(checkpoint.info(scales), wanted, layout.head_dim)
        elif info.dtype not in FLOAT_TABLES:
            raise ValueError(f"{name} is {info.dtype}: this loader takes "
                             f"{', '.join(FLOAT_TABLES)} tables, or F8_E4M3 with a block .scale "
                             "(MXFP8)")
        names[index] = (name, scales if info.dtype == MXFP8.safetensors else None)
    tables = []
    for index, (name, scales) in names.items():
        start, stop = engram_head_rows(layout, index, rank, world_size)
        dtype = MXFP8 if scales is not None else DTYPES[checkpoint.info(name).dtype]
        table = EmbeddingTable.empty(stop - start, layout.head_dim, dtype, placement=placement,
                                     row_start=start, total_rows=layout.rows_per_layer[index])
        table.write_rows(start, checkpoint.read(name, start, stop),
                         None if scales is None else checkpoint.read(scales, start, stop))
        tables.append(table)
    return EngramEmbedding(layout, tables)


def _check_block_scales(info, rows_shape: tuple[int, int], head_dim: int) -> None:
    """An MXFP8 table's ``.scale``: UE8M0 bytes (F8_E8M0, or U8), one per 32 values a row."""
    shape = (rows_shape[0], MXFP8.scale_width(head_dim))
    if info.dtype not in (MXFP8.block_scale_safetensors, "U8") or info.shape != shape:
        raise ValueError(f"{info.name} must be {MXFP8.block_scale_safetensors} (or U8) of shape "
                         f"{list(shape)} (one scale per {MXFP8.block} values), got "
                         f"{info.dtype} of shape {list(info.shape)}")
