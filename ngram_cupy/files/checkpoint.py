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

import os
from collections.abc import Sequence

import numpy as np
from tqdm.auto import tqdm

from ..embedding import NGramEmbedding
from ..formats import (
    BY_SAFETENSORS,
)
from ..hashing.config import NGramConfig
from ..hashing.layout import LayerLayout, layer_layout, split_rows
from ..tables.hot_rows import check_hot_rows
from ..tables.row_cache import DEFAULT_POLICY
from ..tables.storage import (
    TABLE_PLACEMENT,
    RowsSource,
    place,
    placement_list,
    placement_named,
)
from ..tables.table import EmbeddingTable
from .checkpoint_discovery import find_prefix
from .checkpoint_names import (
    owned_pieces,
)
from .checkpoint_reading import (
    block_scale_shards,
    block_scaled_format,
    loaded_format,
    read_scale,
    shared_key,
    table_shards,
    verify_buffers,
)
from .disk_blocks import disk_files, disk_options
from .safetensors_files import Checkpoint


def load_ngram_embedding(
    path: str | os.PathLike | Sequence[str | os.PathLike],
    config: NGramConfig,
    layer: int,
    prefix: str | None = None,
    placement: str = TABLE_PLACEMENT,
    rank: int = 0,
    world_size: int = 1,
    progress: bool | None = None,
    hot_rows=None,
    weight_dtype=None,
    scale_rounding: str = "output",
    cache_bytes: int = 0,
    cache_policy: str = DEFAULT_POLICY,
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
            ``"mmap"`` (rows served from the mapped files, nothing copied) or ``"disk"`` (rows
            read from the files per lookup, around the page cache: docs/disk.md).
        rank, world_size: row sharding: this rank reads only rows
            ``[rank * ceil(N / world_size), (rank + 1) * ceil(N / world_size))``; default 0, 1.
        progress: a tqdm bar; default None: only on a terminal and only if loading takes over
            a second.
        hot_rows: sorted unique global row ids served from a hot tier (see
            :class:`~ngram_cupy.EmbeddingTable`); a rank keeps those among its rows. Default None.
            For ``placement="disk"`` they seed the row cache (within ``cache_bytes``).
        weight_dtype: default None: the rows must be of the config's ``ple_embedding_dtype``
            when it names one (bf16 rows for a float8 config are refused, naming both);
            ``"stored"``: whatever the checkpoint holds; a dtype (float32, float16, bfloat16)
            converts unscaled rows to it while loading.
        scale_rounding: ``"output"`` (default, vLLM 0.33) or ``"float32"`` (EmbeddingTable).
        cache_bytes, cache_policy: ``placement="disk"``'s row cache: host memory for rows read
            recently (default 0: none) and its eviction policy (``"lfu"``, the default,
            ``"lru"`` or ``"clock"``); see docs/disk.md.

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
    options = disk_options(placement, cache_bytes, cache_policy)  # a disk table's row cache
    if config.head_dim is None:
        raise ValueError("config has no embedding_dim (ple_embed_dim): the table size is unknown")
    layout = layer_layout(config, layer)
    row_start, row_stop = rank_rows(layout, rank, world_size)
    hot_rows = rank_hot_rows(hot_rows, layout, (row_start, row_stop), placement, options)
    checkpoint = Checkpoint.open(path, random_access=mapped)
    if prefix is None:
        prefix = find_prefix(checkpoint.tensors, config, layer)
    source, scale = layer_rows(checkpoint, prefix, layout, (row_start, row_stop),
                               loaded=(weight_dtype, placement), progress=progress)
    table = EmbeddingTable(place(placement, source, **options), scale, row_start=row_start,
                           total_rows=layout.padded_rows, hot_rows=hot_rows,
                           scale_rounding=scale_rounding)
    return NGramEmbedding(layout, table)


def rank_hot_rows(hot_rows, layout: LayerLayout, rows: tuple[int, int], placement: str,
                  options: dict):
    """The checked hot rows among a rank's ``rows``: a disk table's seed its row cache instead
    (``options["seed_rows"]``, local) and none is returned; a mapped table has none."""
    if hot_rows is None:
        return None
    if placement_named(placement, mapped=True).mapped and not options:
        raise ValueError(f"hot_rows need placement {placement_list('pinned', 'cpu', 'disk')}, "
                         f"not {placement!r}")
    hot_rows = check_hot_rows(hot_rows, 0, layout.padded_rows)
    hot_rows = hot_rows[np.searchsorted(hot_rows, rows[0]):np.searchsorted(hot_rows, rows[1])]
    if options:
        options["seed_rows"] = hot_rows - rows[0]
        return None
    return hot_rows


def rank_rows(layout: LayerLayout, rank: int, world_size: int) -> tuple[int, int]:
    """The global rows ``[start, stop)`` rank ``rank`` of ``world_size`` holds."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an integer in [0, world_size={world_size}), got {rank!r}")
    return split_rows(layout.padded_rows, world_size, rank)


def layer_rows(checkpoint: Checkpoint, prefix: str, layout: LayerLayout, rows: tuple[int, int],
               loaded: tuple, progress: bool | None) -> tuple[RowsSource, float | None]:
    """The rows ``[start, stop)`` of the layer under ``prefix``, checked against ``layout``, as
    a ``RowsSource`` in the format ``loaded = (weight_dtype, placement)`` asks for, and the
    table's scale."""
    row_start, row_stop = rows
    config = layout.config
    verify_buffers(checkpoint, prefix, layout)
    block_fmt = block_scaled_format(checkpoint, prefix, config)
    dtype, shards = table_shards(checkpoint, prefix, layout, block_fmt)
    stored = BY_SAFETENSORS[dtype] if block_fmt is None else block_fmt
    scale_shards = [None] * len(shards) if block_fmt is None else \
        block_scale_shards(checkpoint, prefix, layout, block_fmt)
    scale = read_scale(checkpoint, prefix, stored)
    target = loaded_format(stored, config, *loaded)
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

    key = shared_key(checkpoint, prefix, [name for name, *_ in pieces], layout.layer, row_start,
                     row_stop, target.name)
    return RowsSource(row_stop - row_start, layout.head_dim, target, blocks, key,
                      mapped_blocks, checkpoint.check_mapped,
                      disk_files(checkpoint, [(name, scales, a, b, lo - row_start)
                                              for name, scales, a, b, lo in pieces],
                                 target, layout.head_dim)), scale
