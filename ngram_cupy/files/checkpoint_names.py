"""The names of a PLE layer's tensors in a checkpoint (docs/checkpoints.md): the table's
shards and scales under a prefix, the hash buffers, and the shards a row range reads."""

from __future__ import annotations

from ..formats import (
    BY_SAFETENSORS,
    FORMATS,
    QWEN4EXP,
    SCALE_FORMATS,
    TensorNames,
)
from ..hashing.layout import LayerLayout, split_rows

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
