"""The PLE checkpoint layout (docs/checkpoints.md): tensor names, shard and rank row ranges, buffer
verification, prefix detection, and loading into / saving from an embedding table.

One layer under prefix ``P`` holds the int64 buffers ``P.layer_multipliers``,
``P.ngram_heads_vocab_sizes`` and ``P.ngram_heads_offsets``, the table rows split into
``P.ngram_embedding.shard_{i}.weight`` for ``i < split_ngram_parts``, and for float8 tables the
scalar ``P.ngram_embedding.weight_scale``. Every tensor a table stores is named by its format's
codec (``Format.checkpoint_names(QWEN4EXP)``): NVFP4 tables store vLLM's names, per shard the
packed ``shard_{i}.weight`` (U8) and its block scales ``shard_{i}.weight_scale`` (F8_E4M3), and
the float32 global scale ``P.ngram_embedding.weight_scale_2``.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from ..embedding import NGramEmbedding
from ..formats import (
    BY_SAFETENSORS,
    FORMATS,
    QWEN4EXP,
    SCALE_FORMATS,
    Format,
    TensorNames,
    find_format,
    storage_format,
)
from ..hashing.config import MAX_SPLIT_PARTS, NGramConfig
from ..hashing.layout import LayerLayout, check_layout, layer_layout, split_rows
from ..runtime.atomic import atomic_file
from ..runtime.backends import HOST, unwrap_torch
from ..runtime.checks import check_scale
from ..tables.hot_rows import check_hot_rows
from ..tables.storage import RowsSource, place, placement_named
from ..tables.table import EmbeddingTable, block_scale_bits
from .safetensors_files import DTYPES, Checkpoint, write_checkpoint

# Safetensors dtype codes of table rows named by their dtype alone.
TABLE_DTYPES = tuple(BY_SAFETENSORS)
# The names every format's rows take in Qwen4Exp checkpoints, and every name a scale takes.
SHARDS = TensorNames().sharded()
SCALE_NAMES = tuple(sorted({fmt.layer_names.scale for fmt in FORMATS if fmt.scaled}))
# The one scale name of plain tables (float8's), and the one block-scaled format Qwen4Exp
# checkpoints hold, which ``ngram_tensors`` writes (a second would need a dtype argument there).
(PLAIN_SCALE,) = {fmt.layer_names.scale for fmt in FORMATS if fmt.scaled and not fmt.blocked}
(BLOCK_SCALED,) = (fmt for fmt in FORMATS if fmt.blocked and fmt.checkpoint_names(QWEN4EXP))
SCALE_DTYPES = tuple(fmt.safetensors for fmt in SCALE_FORMATS)
BUFFERS = ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")
# A per-shard tensor under ``P.ngram_embedding.`` (``SHARDS``' names): its shard and its name.
_SHARD = re.compile(r"shard_(\d+)\.(\w+)")
_PLE_KEY = re.compile(
    r"^(?P<prefix>.+)\.(?:layer_multipliers|ngram_heads_vocab_sizes|ngram_heads_offsets"
    r"|ngram_embedding\.(?:shard_\d+\.weight|weight_scale))$"
)
_LAYER_NUMBER = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


def table_key(prefix: str, name: str, index: int = 0) -> str:
    """The checkpoint name of one of a table's tensors (a ``TensorNames`` entry; ``index`` the
    shard of a sharded one) under ``prefix``."""
    return f"{prefix}.ngram_embedding.{name.format(index=index)}"


def shard_key(prefix: str, index: int) -> str:
    """The name of table shard ``index`` under ``prefix``."""
    return table_key(prefix, SHARDS.rows, index)


def scale_key(prefix: str) -> str:
    """The name of a plain table's scale (float8's ``weight_scale``) under ``prefix``."""
    return table_key(prefix, PLAIN_SCALE)


def default_prefix(layout: LayerLayout) -> str:
    """``model.layers.{i}.ple.ple_embedding`` with ``i`` the layer's decoder module index
    (``ple_layer_ids`` counts from 1, module names from 0)."""
    ids = layout.config.ple_layer_ids
    if ids is not None and layout.layer >= len(ids):
        raise ValueError(f"layer {layout.layer} is past ple_layer_ids {ids}")
    decoder_layer = layout.layer if ids is None else ids[layout.layer] - 1
    return f"model.layers.{decoder_layer}.ple.ple_embedding"


def owned_pieces(
    total_rows: int, parts: int, row_start: int, row_stop: int
) -> list[tuple[int, int, int, int]]:
    """The shards that overlap global rows ``[row_start, row_stop)``, as ``(shard index, the
    shard's first row, lo, hi)`` with ``[lo, hi)`` the overlap: what one rank has to read."""
    pieces = []
    for index in range(parts):
        start, stop = split_rows(total_rows, parts, index)
        lo, hi = max(start, row_start), min(stop, row_stop)
        if lo < hi:
            pieces.append((index, start, lo, hi))
    return pieces


def ple_prefixes(names: Iterable[str]) -> list[str]:
    """Every PLE layer prefix among tensor names, in decoder layer order (the first number in
    the prefix), then by name."""
    found = {m["prefix"] for name in names if (m := _PLE_KEY.match(name))}
    return sorted(found, key=lambda p: (_decoder_layer(p) is None, _decoder_layer(p) or 0, p))


def _decoder_layer(prefix: str) -> int | None:
    """The first all-digit component of a prefix (``model.layers.7.ple...`` -> 7), or None."""
    match = _LAYER_NUMBER.search(prefix)
    return None if match is None else int(match.group(1))


def find_prefix(names: Iterable[str], config: NGramConfig, layer: int) -> str:
    """The prefix of dense PLE layer ``layer``: the prefix whose decoder module index is
    ``config.ple_layer_ids[layer] - 1`` when set (the ids count from 1, as transformers and vLLM
    write them; module names from 0), else the ``layer``-th PLE prefix in decoder order."""
    prefixes = ple_prefixes(names)
    if not prefixes:
        raise ValueError(
            "the checkpoint holds no PLE tensors (*.layer_multipliers, "
            "*.ngram_embedding.shard_N.weight); pass prefix= or check the path"
        )
    numbered: dict[int, list[str]] = {}
    for prefix in prefixes:
        if (number := _decoder_layer(prefix)) is not None:
            numbered.setdefault(number, []).append(prefix)
    if config.ple_layer_ids is not None:
        if layer >= len(config.ple_layer_ids):
            raise ValueError(f"layer {layer} is past ple_layer_ids {config.ple_layer_ids}")
        module = config.ple_layer_ids[layer] - 1
        wanted = (f"decoder module {module} (ple_layer_ids[{layer}] = "
                  f"{config.ple_layer_ids[layer]}, counted from 1)")
        candidates = numbered.get(module, [])
    elif len(prefixes) == 1:
        wanted, candidates = f"PLE layer {layer}", prefixes if layer == 0 else []
    else:
        order = sorted(numbered)
        wanted = f"the PLE layer at position {layer} in decoder order"
        candidates = numbered[order[layer]] if layer < len(order) else []
    if len(candidates) == 1:
        return candidates[0]
    raise ValueError(
        f"cannot tell which PLE prefix is {wanted}: "
        f"{'several match' if candidates else 'none matches'}; found {', '.join(prefixes)} "
        f"({len(prefixes)} PLE layer(s): layers 0 to {len(prefixes) - 1}). "
        "Pass prefix= explicitly"
    )


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


def load_ngram_embedding(
    path: str | os.PathLike | Sequence[str | os.PathLike],
    config: NGramConfig,
    layer: int,
    prefix: str | None = None,
    placement: str = "cpu",
    rank: int = 0,
    world_size: int = 1,
    progress: bool | None = None,
    hot_rows=None,
    weight_dtype=None,
    scale_rounding: str = "output",
):
    """Load one PLE layer from a safetensors checkpoint into a ready ``NGramEmbedding``.

    The hash buffers are checked against the derived layout and every shard's shape and dtype
    against the split before any row is copied; rows are copied shard by shard (peak extra
    memory: one shard), with a progress bar on a terminal.

    Args:
        path: a model folder (its ``model.safetensors.index.json``, else every
            ``*.safetensors`` in it), an index json, one ``.safetensors`` file, or a list.
        config: the model's :class:`~ngram_cupy.NGramConfig` (e.g. ``NGramConfig.from_hf(path)``;
            it must set ``embedding_dim``).
        layer: the PLE layer, counted from 0. With ``config.ple_layer_ids`` (decoder layers
            counted from 1, as transformers and vLLM write them) its tensors are those of the
            module ``model.layers.{ple_layer_ids[layer] - 1}``; without, the ``layer``-th PLE
            prefix in decoder order (:func:`find_prefix`).
        prefix: the tensors' name prefix, e.g. ``"model.layers.0.ple.ple_embedding"``; default
            None: found as above.
        placement: ``"cpu"`` (default), ``"gpu"``, ``"pinned"`` / ``"host"``, ``"shared"`` (one
            segment per node, filled by the first process and attached by the others) or
            ``"mmap"`` (rows served from the mapped files, nothing copied).
        rank, world_size: row sharding: this rank reads only rows
            ``[rank * ceil(N / world_size), (rank + 1) * ceil(N / world_size))``; default 0, 1.
        progress: a tqdm bar; default None: only on a terminal and only if loading takes over
            a second.
        hot_rows: sorted unique global row ids served from a hot tier (see
            :class:`~ngram_cupy.EmbeddingTable`); a rank keeps those among its rows. Default None.
        weight_dtype: default None: the rows must be of the config's ``ple_embedding_dtype``
            when it names one (bf16 rows for a float8 config are refused, naming both);
            ``"stored"``: whatever the checkpoint holds; a dtype (float32, float16, bfloat16)
            converts unscaled rows to it while loading.
        scale_rounding: ``"output"`` (default, vLLM 0.33) or ``"float32"`` (EmbeddingTable).

    Returns:
        An :class:`~ngram_cupy.NGramEmbedding`: ``embedding(tokens, query_start_loc, context)``
        gives ``[T, num_heads * head_dim]``; its ``table`` is the loaded EmbeddingTable.

    Raises:
        ValueError naming the tensor (and the first differing value) for a checkpoint that
        does not match the config; TypeError for a config that is not an NGramConfig.
    """
    if not isinstance(config, NGramConfig):
        raise TypeError(f"config must be an NGramConfig, got {type(config).__name__}")
    mapped = placement_named(placement, mapped=True).mapped
    if config.head_dim is None:
        raise ValueError("config has no embedding_dim (ple_embed_dim): the table size is unknown")
    layout = layer_layout(config, layer)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an integer in [0, world_size={world_size}), got {rank!r}")
    row_start, row_stop = split_rows(layout.padded_rows, world_size, rank)
    if hot_rows is not None:
        if mapped:
            raise ValueError(f"hot_rows need placement 'pinned' or 'cpu', not {placement!r}")
        hot_rows = check_hot_rows(hot_rows, 0, layout.padded_rows)
        hot_rows = hot_rows[np.searchsorted(hot_rows, row_start):
                            np.searchsorted(hot_rows, row_stop)]
    checkpoint = Checkpoint.open(path, random_access=mapped)
    if prefix is None:
        prefix = find_prefix(checkpoint.tensors, config, layer)
    verify_buffers(checkpoint, prefix, layout)
    block_fmt = block_scaled_format(checkpoint, prefix, config)
    dtype, shards = table_shards(checkpoint, prefix, layout, block_fmt)
    stored = BY_SAFETENSORS[dtype] if block_fmt is None else block_fmt
    scale_shards = [None] * len(shards) if block_fmt is None else \
        block_scale_shards(checkpoint, prefix, layout, block_fmt)
    scale = read_scale(checkpoint, prefix, stored)
    target = loaded_format(stored, config, weight_dtype, placement)
    pieces = [  # (shard name, its block scales' name, rows [a, b) of the shard, first global row)
        (shards[index], scale_shards[index], lo - first, hi - first, lo)
        for index, first, lo, hi in owned_pieces(
            layout.padded_rows, config.split_ngram_parts, row_start, row_stop
        )
    ]
    row_bytes = target.row_bytes(layout.head_dim)

    def blocks():
        with tqdm(
            total=(row_stop - row_start) * row_bytes, unit="B", unit_scale=True,
            unit_divisor=1024, desc=f"loading {prefix}",
            disable=None if progress is None else not progress,
            delay=1.0 if progress is None else 0.0,
        ) as bar:
            for name, scales, a, b, lo in pieces:
                rows = checkpoint.read(name, a, b)
                if rows.dtype != target.dtype:  # exact to float32, then rounded once
                    rows = rows.astype(np.float32).astype(target.dtype)
                block_scales = None if scales is None else checkpoint.read(scales, a, b)
                yield lo - row_start, rows, block_scales
                bar.update((b - a) * row_bytes)

    def mapped_blocks():
        return [(lo - row_start, checkpoint.view(name)[a:b])
                + (() if scales is None else (checkpoint.view(scales)[a:b],))
                for name, scales, a, b, lo in pieces]

    key = shared_key(checkpoint, prefix, [name for name, *_ in pieces], layer, row_start,
                     row_stop, target.name)
    source = RowsSource(row_stop - row_start, layout.head_dim, target, blocks, key,
                        mapped_blocks, checkpoint.check_mapped)
    table = EmbeddingTable(place(placement, source), scale, row_start=row_start,
                           total_rows=layout.padded_rows, hot_rows=hot_rows,
                           scale_rounding=scale_rounding)
    return NGramEmbedding(layout, table)


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


def _host_values(value, name: str) -> np.ndarray:
    """A NumPy view of a host array; torch bfloat16 / float8 tensors (which NumPy cannot import)
    come as their ``ml_dtypes`` type."""
    value, fmt = unwrap_torch(value)
    array = HOST.asarray(value)
    return array if fmt is None else array.view(fmt.dtype)


def ngram_tensors(
    layout: LayerLayout,
    weight,
    scale=None,
    parts: int | None = None,
    prefix: str | None = None,
    block_scales=None,
) -> dict[str, np.ndarray]:
    """One layer's tensors in the checkpoint layout: buffers, shards (views of ``weight``, no
    copies) and the float8 scale; with ``block_scales``, a ``BLOCK_SCALED`` (NVFP4) table: the
    packed shards, their block scales and the global ``scale`` in vLLM's names. ``parts``
    defaults to ``split_ngram_parts``; ``prefix`` to :func:`default_prefix`."""
    check_layout(layout)
    weight = _host_values(weight, "weight")
    parts = layout.config.split_ngram_parts if parts is None else parts
    if isinstance(parts, bool) or not isinstance(parts, (int, np.integer)) \
            or not 1 <= parts <= MAX_SPLIT_PARTS:
        raise ValueError(f"parts must be an integer in [1, {MAX_SPLIT_PARTS}], got {parts!r}")
    prefix = default_prefix(layout) if prefix is None else prefix
    if block_scales is not None:
        return block_scaled_tensors(layout, weight, scale, block_scales, parts, prefix)
    fmt = find_format(weight.dtype)
    if fmt is None or weight.dtype != fmt.dtype:
        raise TypeError(
            "weight must be float32, float16, bfloat16 or float8_e4m3fn, got " f"{weight.dtype}"
        )
    if weight.ndim != 2 or weight.shape != (layout.padded_rows, layout.head_dim):
        raise ValueError(
            f"weight must have shape (padded_rows, head_dim) = "
            f"{(layout.padded_rows, layout.head_dim)}, got {tuple(weight.shape)}"
        )
    scaled = fmt.scaled
    if scaled != (scale is not None):
        raise ValueError(
            f"scale is {'required' if scaled else 'only allowed'} for float8 tables "
            f"(weight is {weight.dtype})"
        )
    tensors = {
        f"{prefix}.{buffer}": np.array(values, dtype=np.int64)
        for buffer, values in zip(
            BUFFERS, (layout.multipliers, layout.head_sizes, layout.head_offsets), strict=True
        )
    }
    for index in range(parts):
        start, stop = split_rows(layout.padded_rows, parts, index)
        tensors[shard_key(prefix, index)] = weight[start:stop]
    if scaled:
        scale = _host_values(scale, "scale")
        if scale.dtype not in (scale_format.dtype for scale_format in SCALE_FORMATS):
            scale = scale.astype(np.float32)
        if scale.size != 1:
            raise ValueError(f"scale must be a single value, got shape {scale.shape}")
        check_scale("scale", float(scale.reshape(())))
        tensors[scale_key(prefix)] = scale.reshape(())
    return tensors


def _buffer_tensors(layout: LayerLayout, prefix: str) -> dict[str, np.ndarray]:
    """The three int64 hash buffers of a layer, named under ``prefix``."""
    return {
        f"{prefix}.{buffer}": np.array(values, dtype=np.int64)
        for buffer, values in zip(
            BUFFERS, (layout.multipliers, layout.head_sizes, layout.head_offsets), strict=True
        )
    }


def block_scaled_tensors(layout: LayerLayout, weight: np.ndarray, scale, block_scales,
                         parts: int, prefix: str) -> dict[str, np.ndarray]:
    """``ngram_tensors`` of a ``BLOCK_SCALED`` table (NVFP4): ``weight`` its stored
    ``[padded_rows, head_dim / pack]`` (packed uint8 bytes), ``block_scales`` their
    ``[padded_rows, head_dim / block]`` scales (or bits), ``scale`` the float32 global scale;
    all checked before anything is built."""
    fmt = BLOCK_SCALED
    names = fmt.checkpoint_names(QWEN4EXP)
    fmt.check_head_dim(layout.head_dim)
    shape = (layout.padded_rows, fmt.row_width(layout.head_dim))
    if weight.dtype != fmt.dtype:
        raise ValueError(f"weight must be the packed {fmt.dtype} bytes of an {fmt.name} table "
                         f"(a cast would reinterpret them), got {weight.dtype}")
    if weight.shape != shape:
        raise ValueError(f"weight must have shape (padded_rows, head_dim / {fmt.pack}) = "
                         f"{shape}, got {tuple(weight.shape)}")
    block_scales, block_format = unwrap_torch(block_scales)
    block_scales = HOST.asarray(block_scales)
    bits = block_scale_bits(fmt, block_scales, block_format, layout.padded_rows,
                            layout.head_dim).view(fmt.block_scale)
    if scale is None:
        raise ValueError(f"scale ({names.scale}, the global scale) is required for {fmt.name} "
                         "tables")
    scale = _host_values(scale, "scale")
    if scale.size != 1:
        raise ValueError(f"scale must be a single value, got shape {scale.shape}")
    global_scale = np.float32(check_scale("scale", float(scale.reshape(()))))
    tensors = _buffer_tensors(layout, prefix)
    for index in range(parts):
        start, stop = split_rows(layout.padded_rows, parts, index)
        tensors[table_key(prefix, names.rows, index)] = weight[start:stop]
        tensors[table_key(prefix, names.block_scales, index)] = bits[start:stop]
    tensors[table_key(prefix, names.scale)] = np.array(global_scale, dtype=np.float32)
    return tensors


def save_ngram_embedding(
    path: str | os.PathLike,
    config: NGramConfig | LayerLayout,
    layer,
    weight=None,
    scale=None,
    *,
    parts: int | None = None,
    prefix: str | None = None,
    num_files: int = 1,
    write_config: bool = True,
    block_scales=None,
) -> list[str]:
    """Write one layer in the checkpoint layout, atomically; return the files written.

    The mirror of :func:`load_ngram_embedding`: ``config`` and the dense PLE ``layer`` index name
    the layout. ``path`` ending in ``.safetensors`` is a single file; anything else a folder with
    ``num_files`` files and an index json (see :func:`write_checkpoint`), and, unless
    ``write_config=False``, the config's ``config.json`` (merged into one already there), so that
    ``load_ngram_embedding(path, NGramConfig.from_hf(path), layer)`` reads it back. ``weight`` is
    the padded table ``[padded_rows, head_dim]`` in float32, float16, bfloat16 or float8 e4m3
    (then with ``scale``); ``parts`` defaults to ``config.split_ngram_parts``. To write several
    layers in one checkpoint, merge their :func:`ngram_tensors` and call
    :func:`write_checkpoint` once. The older form ``(path, layout, weight, scale)`` is accepted.
    With ``block_scales`` the table is NVFP4 (``BLOCK_SCALED``): its packed uint8 ``weight``
    ``[padded_rows, head_dim / 2]`` with ``block_scales`` (E4M3 ``[padded_rows, head_dim / 16]``)
    and the float32 global ``scale``, written in vLLM's names (``shard_{i}.weight``,
    ``shard_{i}.weight_scale``, ``weight_scale_2``).
    """
    if isinstance(config, LayerLayout):  # the older form: (path, layout, weight, scale)
        layout, weight, scale = config, layer, weight
    elif isinstance(config, NGramConfig) and isinstance(layer, (int, np.integer)) \
            and not isinstance(layer, bool):
        layout = layer_layout(config, layer)
    else:
        raise TypeError(f"layout must be a LayerLayout, or config an NGramConfig with an integer "
                        f"layer; got {type(config).__name__} and {type(layer).__name__}")
    tensors = ngram_tensors(layout, weight, scale, parts, prefix, block_scales)  # checks first
    config_too = write_config and not os.fspath(path).endswith(".safetensors")
    if config_too:  # checked before anything is written: the pair must load back
        if parts is not None and parts != layout.config.split_ngram_parts:
            raise ValueError(
                f"parts={parts!r} differs from the config's split_ngram_parts="
                f"{layout.config.split_ngram_parts}: the config.json written beside it would not "
                f"load the checkpoint (pass write_config=False to write the shards alone)")
        existing_config(path)
    files = write_checkpoint(path, tensors, num_files)
    if config_too:
        write_config_json(path, layout.config)
    return files


def existing_config(folder: str | os.PathLike) -> dict:
    """The JSON object of ``folder/config.json`` ({} when there is none); a ValueError naming
    the file when it is not one, rather than replacing a model's config it cannot read."""
    path = Path(folder) / "config.json"
    if not path.exists():
        return {}
    try:
        existing = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} exists but is not readable JSON ({e}); fix or remove it") \
            from None
    if not isinstance(existing, dict):
        raise ValueError(f"{path} exists but holds a {type(existing).__name__}, not a JSON object")
    return existing


def write_config_json(folder: str | os.PathLike, config: NGramConfig) -> str:
    """Write ``config`` into ``folder/config.json`` (keys of a model's config already there are
    kept), atomically; return its path."""
    path = Path(folder) / "config.json"
    merged = {**existing_config(folder), **config.to_hf()}
    with atomic_file(path) as temporary:
        Path(temporary).write_text(json.dumps(merged, indent=2, sort_keys=True) + "\n")
    return str(path)
