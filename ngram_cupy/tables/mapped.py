"""A CPU table served straight from memory-mapped checkpoint shards (``storage.mapped``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from .formats import storage_format
from .storage.mapped import MappedStorage
from .table import EmbeddingTable


class MappedTable(EmbeddingTable):
    """Global rows ``[row_start, row_stop)`` of a ``total_rows`` table, served from mapped blocks.

    ``blocks``: ``(first global row, rows)`` pairs tiling ``[row_start, row_stop)`` in order;
    ``guard``, called before every gather, raises if the files behind them changed.
    Lookups give exactly what an ``EmbeddingTable`` holding the same rows gives (ids outside the
    owned rows: zero rows), on the CPU; the rows are read-only.
    """

    def __init__(
        self,
        blocks: Sequence[tuple[int, np.ndarray]],
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
        next_row = row_start
        for start, rows in blocks:
            if start != next_row or rows.shape[1:] != (head_dim,) or rows.dtype != fmt.dtype:
                raise ValueError(
                    f"blocks must tile rows [{row_start}, {row_stop}) in order, as "
                    f"[n, {head_dim}] {fmt.name} arrays"
                )
            next_row += rows.shape[0]
        if next_row != row_stop:
            raise ValueError(f"blocks must tile rows [{row_start}, {row_stop}) in order")
        storage = MappedStorage([(start - row_start, rows) for start, rows in blocks], head_dim,
                                fmt, guard)
        super().__init__(storage, scale, row_start=row_start, total_rows=total_rows,
                         scale_rounding=scale_rounding)
