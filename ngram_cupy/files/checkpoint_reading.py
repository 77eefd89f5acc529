"""Reading one PLE layer's tensors: the hash buffers checked against the layout, the table's
shards, block scales and scale found and checked, and the format they load in."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence

import numpy as np

from ..formats import (
    BY_SAFETENSORS,
    FORMATS,
    QWEN4EXP,
    Format,
    TensorNames,
    find_format,
    storage_format,
)
from ..hashing.config import NGramConfig
from ..hashing.layout import LayerLayout, split_rows
from ..runtime.checks import check_scale
from ..tables.storage import placement_named
from .checkpoint_names import (
    BUFFERS,
    PLAIN_SCALE,
    SCALE_DTYPES,
    SCALE_NAMES,
    TABLE_DTYPES,
    table_key,
)
from .safetensors_files import DTYPES, Checkpoint

# A per-shard tensor under ``P.ngram_embedding.`` (``SHARDS``' names): its shard and its name.
_SHARD = re.compile(r"shard_(\d+)\.(\w+)")


def verify_buffers(checkpoint: Checkpoint, prefix: str, layout: LayerLayout) -> None:
    """The three int64 hash buffers must equal the derived layout in shape and every value."""
    expected = dict(
        zip(BUFFERS, (layout.multipliers, layout.head_sizes, layout.head_offsets), strict=True)
    )
    for buffer, want in expected.items():
        name = f"{prefix}.{buffer}"
        info = checkpoint.info(name)
        if not np.issubdtype(DTYPES.get(info.dtype, np.dtype(object)), np.integer):
            raise ValueError(f"{name} must be an integer buffer (I64), got dtype {info.dtype}")
        if info.shape != want.shape:
            raise ValueError(
                f"{name} has shape {info.shape} but the layout of layer {layout.layer} "
                f"needs {want.shape}"
            )
        got = checkpoint.read(name).astype(np.int64)
        differ = np.flatnonzero(got != want)
        if differ.size:
            i = int(differ[0])
            raise ValueError(
                f"{name} differs from the layout of layer {layout.layer} first at index {i}: "
                f"checkpoint has {int(got[i])}, layout derives {int(want[i])}"
            )


def table_shards(checkpoint: Checkpoint, prefix: str, layout: LayerLayout,
                 fmt: Format | None = None) -> tuple[str, list]:
    """Check every shard's presence, index, shape and dtype from the headers alone; return the
    table's safetensors dtype and the shard names by index (None for an empty shard the
    checkpoint leaves out, as vLLM's writer does for the zero-row tail shards). With a
    block-scaled ``fmt`` the shards must be its stored type (a cast would reinterpret them)."""
    parts = layout.config.split_ngram_parts
    found: dict[int, str] = {}
    stored = TensorNames() if fmt is None else fmt.layer_names  # what a shard holds
    others = []  # per-shard tensors the format does not store (per-channel scales, ...)
    for name in checkpoint.tensors:
        start = f"{prefix}.ngram_embedding."
        if not (name.startswith(start) and (m := _SHARD.fullmatch(name[len(start):]))):
            continue
        if m.group(2) == stored.rows:
            found[int(m.group(1))] = name
        elif m.group(2) != stored.block_scales:
            others.append(name)
    past = sorted(i for i in found if i >= parts)
    if past:
        raise ValueError(
            f"{found[past[0]]}: shard index {past[0]} is at or past "
            f"split_ngram_parts={parts}"
        )
    bounds = [split_rows(layout.padded_rows, parts, index) for index in range(parts)]
    missing = [i for i, (start, stop) in enumerate(bounds) if i not in found and stop > start]
    if missing:
        shown = ", ".join(map(str, missing[:20])) + (", ..." if len(missing) > 20 else "")
        raise ValueError(
            f"{len(missing)} of {parts} table shards missing under {prefix}: indexes {shown}"
        )
    names = [found.get(i) for i in range(parts)]
    first = found[min(found)]
    dtype = checkpoint.info(first).dtype
    width = layout.head_dim
    if fmt is not None:
        width = fmt.row_width(layout.head_dim)
        if dtype != fmt.safetensors:
            raise ValueError(f"{first} has dtype {dtype}, but {fmt.name} rows are stored as "
                             f"{fmt.safetensors}: a cast would reinterpret them")
    elif dtype not in TABLE_DTYPES:
        raise ValueError(f"{first} has dtype {dtype}; tables are {', '.join(TABLE_DTYPES)}")
    if others:
        kind = BY_SAFETENSORS[dtype].name if fmt is None else fmt.name
        raise ValueError(f"{others[0]}: {kind} tables store no per-shard "
                         f"{others[0].rsplit('.', 1)[-1]} (a format this loader does not read, "
                         f"e.g. per-channel scales)")
    for index, name in enumerate(names):
        if name is None:
            continue
        info = checkpoint.info(name)
        start, stop = bounds[index]
        if info.shape != (stop - start, width):
            raise ValueError(
                f"{name} has shape {info.shape} but shard {index} of {layout.padded_rows} rows "
                f"in {parts} parts must be {(stop - start, width)}"
            )
        if info.dtype != dtype:
            raise ValueError(f"{name} has dtype {info.dtype} but {first} has {dtype}")
    return dtype, names


def read_scale(checkpoint: Checkpoint, prefix: str, fmt: Format) -> float | None:
    """The table's one scale as a float (None for formats without one), checked; a scale of
    another format's name beside a table without one is refused."""
    name = fmt.layer_names.scale
    if name is None:
        for other in (table_key(prefix, scale) for scale in SCALE_NAMES):
            if other in checkpoint:
                raise ValueError(f"{other} is present but the table is {fmt.safetensors}, "
                                 "which takes no scale")
        return None
    name = table_key(prefix, name)
    if name not in checkpoint:
        raise ValueError(f"the checkpoint has no tensor {name} (the {fmt.name} table's scale "
                         "is missing)")
    info = checkpoint.info(name)
    if info.dtype not in SCALE_DTYPES or len(info.shape) > 1 or np.prod(info.shape) != 1:
        raise ValueError(
            f"{name} must hold one float ({', '.join(SCALE_DTYPES)}), "
            f"got {info.dtype} of shape {info.shape}"
        )
    return check_scale(name, float(checkpoint.read(name).reshape(())))


def _holds_block_tensors(checkpoint: Checkpoint, prefix: str, fmt: Format) -> bool:
    """Whether the checkpoint holds, under ``prefix``, tensors only block-scaled ``fmt``
    stores: block scales of its type (or of any type beside rows of a type only it has, NVFP4's
    U8), or a scale of a name only it has (NVFP4's global)."""
    names = fmt.layer_names.sharded()
    scales, rows = (table_key(prefix, name, 0) for name in (names.block_scales, names.rows))
    if scales in checkpoint and checkpoint.info(scales).dtype == fmt.block_scale_safetensors:
        return True
    if scales in checkpoint and rows in checkpoint and fmt.safetensors not in TABLE_DTYPES \
            and checkpoint.info(rows).dtype == fmt.safetensors:
        return True
    distinct = names.scale is not None and names.scale != PLAIN_SCALE
    return distinct and table_key(prefix, names.scale) in checkpoint


def block_scaled_format(checkpoint: Checkpoint, prefix: str, config: NGramConfig) -> Format | None:
    """The layer's block-scaled format, or None: the one whose tensors the checkpoint holds, or
    the config's ``ple_embedding_dtype``. A format whose Qwen4Exp checkpoints are not read yet
    (``Format.checkpoints``), or a config naming another format, is a ValueError."""
    named = find_format(config.ple_embedding_dtype) if config.ple_embedding_dtype else None
    stored = next((fmt for fmt in FORMATS
                   if fmt.blocked and _holds_block_tensors(checkpoint, prefix, fmt)), None)
    found = stored or (named if named is not None and named.blocked else None)
    if found is None:
        return None
    names = found.layer_names.sharded()
    evidence = [table_key(prefix, name, 0) for name in (names.scale, names.block_scales) if name]
    if found.checkpoint_names(QWEN4EXP) is None:
        label = found.name.upper()
        raise ValueError(f"{prefix} holds an {label} table ({found.safetensors} shards with "
                         f"{found.block_scale_safetensors} block scales {evidence[-1]}): "
                         f"checkpoints of {label} tables are not loaded yet; build it with "
                         f"EmbeddingTable(rows, dtype='{found.name}', block_scales=...)")
    if stored is not None and named is not None and named != stored:
        raise ValueError(f"{prefix} holds an {stored.name.upper()} table "
                         f"({', '.join(evidence)}) but the config's ple_embedding_dtype is "
                         f"{config.ple_embedding_dtype!r}")
    return found


def block_scale_shards(checkpoint: Checkpoint, prefix: str, layout: LayerLayout,
                       fmt: Format) -> list[str | None]:
    """The checked names of every shard's block scales of a block-scaled table; an unsharded
    weight is refused."""
    names = fmt.checkpoint_names(QWEN4EXP)
    unsharded = table_key(prefix, fmt.layer_names.rows)
    if unsharded in checkpoint:
        raise ValueError(f"{unsharded}: an unsharded {fmt.name} weight is refused; its rows are "
                         f"stored per shard ({names.rows.format(index='{i}')} with "
                         f"{names.block_scales.format(index='{i}')})")
    parts = layout.config.split_ngram_parts
    bounds = [split_rows(layout.padded_rows, parts, index) for index in range(parts)]
    keys = [table_key(prefix, names.block_scales, index) for index in range(parts)]
    found = [key if key in checkpoint or stop > start else None
             for key, (start, stop) in zip(keys, bounds, strict=True)]
    missing = [index for index, key in enumerate(found)
               if key is not None and key not in checkpoint]
    if missing:
        shown = ", ".join(map(str, missing[:20])) + (", ..." if len(missing) > 20 else "")
        raise ValueError(f"{len(missing)} of {parts} block scale shards "
                         f"({names.block_scales.format(index='{i}')}) missing under {prefix}: "
                         f"indexes {shown}")
    for index, key in enumerate(found):
        if key is None:  # an empty shard's scales, left out like its rows
            continue
        info = checkpoint.info(key)
        start, stop = bounds[index]
        shape = (stop - start, fmt.scale_width(layout.head_dim))
        if info.dtype != fmt.block_scale_safetensors or info.shape != shape:
            raise ValueError(f"{key} must be {fmt.block_scale_safetensors} of shape {shape} (one "
                             f"scale per {fmt.block} values), got {info.dtype} of shape "
                             f"{info.shape}")
    return found


def shared_key(checkpoint: Checkpoint, prefix: str, shards: Sequence[str], layer: int,
               row_start: int, row_stop: int, dtype: str) -> str:
    """What identifies a shared segment's rows: the files holding ``shards`` (real path, size,
    modification time), the prefix and layer, the row range and the storage dtype."""
    files = []
    for path in sorted({checkpoint.info(name).path for name in shards}):
        stat = os.stat(path)
        files.append([os.path.realpath(path), stat.st_size, stat.st_mtime_ns])
    return json.dumps({"files": files, "prefix": prefix, "layer": layer,
                       "rows": [row_start, row_stop], "dtype": dtype})


def loaded_format(stored: Format, config: NGramConfig, weight_dtype, placement: str) -> Format:
    """The format a table stored as ``stored`` is loaded in (see ``load_ngram_embedding``'s
    ``weight_dtype``): a ValueError naming both dtypes for a silent mismatch with the config."""
    if isinstance(weight_dtype, str) and weight_dtype == "stored":
        return stored
    if weight_dtype is None:
        declared = find_format(config.ple_embedding_dtype or stored.dtype)
        if declared is not None and declared.code != stored.code:
            convert = ("" if declared.scaled or stored.scaled
                       else f", or weight_dtype='{declared.name}' to convert them")
            raise ValueError(
                f"the checkpoint stores {stored.name} ({stored.safetensors}) table rows but the "
                f"config's ple_embedding_dtype is {declared.name}: pass weight_dtype='stored' to "
                f"load them as {stored.name}{convert}")
        return stored
    wanted = storage_format(weight_dtype, "weight_dtype")
    if wanted.code == stored.code:
        return stored
    if wanted.scaled or stored.scaled:
        raise ValueError(f"weight_dtype={wanted.name} would convert {stored.name} rows, but "
                         "conversions to or from float8 need a scale: load them as stored")
    if placement_named(placement, mapped=True).mapped:
        raise ValueError(f"weight_dtype={wanted.name} would convert {stored.name} rows, but an "
                         "mmap table serves the rows as stored")
    return wanted
