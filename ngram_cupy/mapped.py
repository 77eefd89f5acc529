"""A CPU table served straight from memory-mapped checkpoint shards, for tables larger than RAM.

The rows stay in the files (mapped with ``madvise(MADV_RANDOM)``, so a lookup faults in only the
pages it reads, without read-ahead); nothing is loaded up front. Shards can live in different
files, so the rows are a sequence of contiguous blocks, each a read-only mapped view. Everything
but the gather is ``EmbeddingTable``'s (argument checks, ``out=``, prefetch on a worker thread);
the gather groups the ids by block and runs the tables' CPU gather (``gather_numba``) on each.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from . import gather_numba
from .arrays import DEVICE
from .dequant import storage_format
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
        self._starts = np.array([start for start, _ in blocks], dtype=np.int64)
        self._blocks = [rows.view(fmt.raw) for _, rows in blocks]
        self._guard = guard
        self._setup(row_stop - row_start, head_dim, fmt, "cpu", scale, row_start, total_rows,
                    dedup=False)
        self.placement = "mmap"

    def _allocate(self, storage, storage_side) -> bool:
        """No storage of its own: the rows are the mapped blocks."""
        return False

    def _check_side(self, side: str) -> None:
        """Only CPU lookups: the GPU cannot read the mapped files."""
        if side == DEVICE:
            raise ValueError("an mmap table is read on the CPU: pass NumPy (or CPU torch) ids")

    def write_rows(self, start: int, rows) -> None:
        """Refused: the rows are the checkpoint's, mapped read-only."""
        raise ValueError("an mmap table serves the checkpoint's rows as they are: it is read-only")

    def _gather(self, request, ids, out, expected=None, worker: bool = False) -> None:
        """Write the rows of ``ids`` into ``out``: every head, or with ``expected`` (a finished
        prefetch already in ``out``) only the heads whose id differs from it. ``guard`` first
        checks that the mapped files are still whole (a read past a shrunk file's end is a
        SIGBUS, not an exception)."""
        if self._guard is not None:
            self._guard()
        flat = ids.reshape(-1)
        rows = out.view(request.out_format.raw).reshape(-1, self.head_dim)
        where = (np.arange(flat.size) if expected is None
                 else np.flatnonzero(expected.reshape(-1) != flat))
        rows[where] = 0
        wanted = flat[where]
        owned = (wanted >= self.row_start) & (wanted < self.row_start + self.num_rows)
        where, wanted = where[owned], wanted[owned]
        block = np.searchsorted(self._starts, wanted, side="right") - 1
        order = np.argsort(block, kind="stable")
        where, wanted, block = where[order], wanted[order], block[order]
        bounds = np.flatnonzero(np.diff(block, prepend=-1, append=len(self._blocks)))
        scale = np.float32(1.0) if self.scale is None else self.scale
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
            gathered = np.empty((hi - lo, self.head_dim), dtype=rows.dtype)
            gather_numba.gather_rows(
                self._blocks[block[lo]], self.format.code, int(self._starts[block[lo]]), scale,
                wanted[lo:hi].reshape(-1, 1), gathered, request.out_format.code,
                parallel=False if worker else None,
            )
            rows[where[lo:hi]] = gathered
