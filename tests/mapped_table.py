"""A test fixture: a CPU table served straight from memory-mapped blocks the test hands it
(``tables.storage.mapped``), to check mapped gathers against plain ones."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ngram_cupy.codecs.scales import block_scale_bits
from ngram_cupy.formats import storage_format
from ngram_cupy.tables.storage.mapped import MappedStorage
from ngram_cupy.tables.table import EmbeddingTable


class MappedTable(EmbeddingTable):
    """Global rows ``[row_start, row_stop)`` of a ``total_rows`` table, served from mapped blocks.

    ``blocks``: ``(first global row, rows)`` pairs tiling ``[row_start, row_stop)`` in order
    (block-scaled formats: ``(first global row, packed rows, block scales)``); ``guard``, called
    before every gather, raises if the files behind them changed.
    Lookups give exactly what an ``EmbeddingTable`` holding the same rows gives (ids outside the
    owned rows: zero rows), on the CPU; the rows are read-only.
    """

    def __init__(
        self,
        blocks: Sequence[tuple],
        head_dim: int,
        dtype,
        scale: float | None,
        row_start: int,
        row_stop: int,
        total_rows: int,
        guard: Callable[[], None] | None = None,
        scale_rounding: str = "output",
    ):
        fmt = storage_format(dtype)
        fmt.check_head_dim(head_dim)
        width = fmt.row_width(head_dim)
        next_row = row_start
        for start, rows, *scales in blocks:
            if start != next_row or rows.shape[1:] != (width,) or rows.dtype != fmt.dtype:
                raise ValueError(
                    f"blocks must tile rows [{row_start}, {row_stop}) in order, as "
                    f"[n, {width}] {fmt.name} arrays"
                )
            if len(scales) != fmt.blocked:
                raise ValueError(f"{fmt.name} blocks are (first row, rows"
                                 f"{', block scales' if fmt.blocked else ''})")
            block_scale_bits(fmt, scales[0] if scales else None, None, rows.shape[0], head_dim)
            next_row += rows.shape[0]
        if next_row != row_stop:
            raise ValueError(f"blocks must tile rows [{row_start}, {row_stop}) in order")
        storage = MappedStorage([(block[0] - row_start, *block[1:]) for block in blocks],
                                head_dim, fmt, guard)
        super().__init__(storage, scale, row_start=row_start, total_rows=total_rows,
                         scale_rounding=scale_rounding)
