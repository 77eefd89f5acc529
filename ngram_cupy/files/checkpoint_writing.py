"""Writing one PLE layer in the checkpoint layout: its tensors by name, and the files."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np

from ..codecs.scales import block_scale_bits
from ..formats import (
    QWEN4EXP,
    SCALE_FORMATS,
    find_format,
)
from ..hashing.config import MAX_SPLIT_PARTS, NGramConfig
from ..hashing.layout import LayerLayout, check_layout, layer_layout, split_rows
from ..runtime.backends import HOST, unwrap_torch
from ..runtime.checks import check_scale
from ..tables.table import EmbeddingTable
from .checkpoint_discovery import ple_prefixes
from .checkpoint_names import (
    BLOCK_SCALED,
    BUFFERS,
    default_prefix,
    scale_key,
    shard_key,
    table_key,
)
from .config_json import existing_config, write_config_json
from .safetensors_files import INDEX_FILE, Checkpoint, read_index, write_checkpoint


def _host_values(value, name: str) -> np.ndarray:
    """A NumPy view of a host array; torch bfloat16 / float8 tensors (which NumPy cannot import)
    come as their ``ml_dtypes`` type."""
    value, fmt = unwrap_torch(value)
    array = HOST.asarray(value)
    return array if fmt is None else array.view(fmt.dtype)


def table_tensors(table: EmbeddingTable, scale, block_scales) -> tuple:
    """``(weight, scale, block_scales)`` of a whole table, read after its pending updates (its
    host rows, or a host copy of its GPU rows); ``scale`` and ``block_scales`` must be None (the
    table brings its own)."""
    if scale is not None or block_scales is not None:
        raise ValueError("weight is an EmbeddingTable: it brings its own scale and block_scales")
    if table.row_start != 0 or table.num_rows != table.total_rows:
        raise ValueError(f"weight holds rows [{table.row_start}, "
                         f"{table.row_start + table.num_rows}) of {table.total_rows}: save the "
                         "whole table, not one shard")
    rows, scales = table.host_view, table.host_scales
    if rows is None:  # in GPU memory
        rows, scales = table.device_rows.get(), table.device_scales
        scales = None if scales is None else scales.get()
    return rows.view(table.format.dtype), table.scale, scales


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
    (then with ``scale``), or a whole ``EmbeddingTable`` of any of those formats or NVFP4 (its
    rows, scale and block scales, read after its pending updates); ``parts`` defaults to
    ``config.split_ngram_parts``. A folder keeps the other PLE layers it holds
    (:func:`other_layers`): saving layer after layer into one folder adds each, and saving a
    layer again replaces it; the folder is rewritten as a whole each time (to write many
    layers at once, merge their :func:`ngram_tensors` and call :func:`write_checkpoint`). The
    older form ``(path, layout, weight, scale)`` is accepted.
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
    if isinstance(weight, EmbeddingTable):
        weight, scale, block_scales = table_tensors(weight, scale, block_scales)
    tensors = ngram_tensors(layout, weight, scale, parts, prefix, block_scales)  # checks first
    folder = not os.fspath(path).endswith(".safetensors")
    config_too = write_config and folder
    if config_too:  # checked before anything is written: the pair must load back
        if parts is not None and parts != layout.config.split_ngram_parts:
            raise ValueError(
                f"parts={parts!r} differs from the config's split_ngram_parts="
                f"{layout.config.split_ngram_parts}: the config.json written beside it would not "
                f"load the checkpoint (pass write_config=False to write the shards alone)")
        existing_config(path)
    kept, replaced = other_layers(path, default_prefix(layout) if prefix is None else prefix) \
        if folder else ({}, set())
    if kept and config_too:
        check_folder_config(path, layout.config)
    files = write_checkpoint(path, {**kept, **tensors}, num_files, replaces=replaced)
    if config_too:
        write_config_json(path, layout.config)
    return files


def other_layers(folder: str | os.PathLike, prefix: str) -> tuple[dict[str, np.ndarray],
                                                                    set[str]]:
    """What a folder's live checkpoint holds beside the layer under ``prefix``: the tensors of
    its other PLE layers (mapped views, carried into the rewrite) and the names of the layer's
    own old tensors (replaced). Nothing is carried from a folder without a readable index, or
    whose index names other tensors too (another model's, which ``write_checkpoint`` refuses
    to replace)."""
    index = Path(folder) / INDEX_FILE
    try:
        weight_map = read_index(index)[0] if index.is_file() else {}
    except ValueError:
        return {}, set()
    own = {name for name in weight_map if name.startswith(f"{prefix}.")}
    layers = tuple(f"{other}." for other in ple_prefixes(weight_map) if other != prefix)
    others = [name for name in weight_map if name not in own and name.startswith(layers)]
    if not others or len(own) + len(others) < len(weight_map):
        return {}, own
    checkpoint = Checkpoint.open(folder)
    return {name: checkpoint.view(name) for name in others}, own


def check_folder_config(folder: str | os.PathLike, config: NGramConfig) -> None:
    """A ValueError when the folder's ``config.json`` holds another n-gram config than
    ``config``: the folder's other layers were saved with it, and would not load with this
    one written over it."""
    try:
        theirs = NGramConfig.from_hf(existing_config(folder))
    except (ValueError, TypeError):
        return  # no n-gram config there (the layers were saved with write_config=False)
    differ = [field.name for field in dataclasses.fields(config)
              if getattr(theirs, field.name) != getattr(config, field.name)]
    if differ:
        shown = ", ".join(f"{name} {getattr(theirs, name)!r} there, {getattr(config, name)!r} "
                          "here" for name in differ)
        raise ValueError(f"{Path(folder) / 'config.json'} holds another n-gram config ({shown})"
                         f": the folder's other layers were saved with it; save every layer of "
                         f"a folder with one config, or into a new folder")
