"""Rows served straight from memory-mapped checkpoint shards, for tables larger than RAM.

The rows stay in the files (mapped with ``madvise(MADV_RANDOM)``, so a lookup faults in only the
pages it reads, without read-ahead); nothing is loaded up front. Shards can live in different
files, so the rows are a sequence of contiguous blocks, each a read-only mapped view; the gather
groups the ids by block and runs the CPU gather (``gather_numba``) on each.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ...runtime.backends import HOST, Backend
from .. import gather_numba
from ..formats import Format
from .base import Gather, Storage


class MappedStorage(Storage):
    """Local rows ``[0, sum of block rows)`` as read-only mapped blocks, read on the CPU.

    ``blocks``: ``(first local row, raw-or-typed rows)`` pairs tiling the rows in order (a
    block-scaled format's: ``(first local row, packed rows, block scales)``); ``guard``, called
    before every gather, raises if the files behind them changed (a read past a shrunk file's
    end is a SIGBUS, not an exception).
    """

    placement = "mmap"
    writable = False

    def __init__(self, blocks: Sequence[tuple], head_dim: int, fmt: Format,
                 guard: Callable[[], None] | None = None):
        super().__init__(sum(block[1].shape[0] for block in blocks), head_dim, fmt)
        self.guard = guard
        self.starts = np.array([block[0] for block in blocks], dtype=np.int64)
        self.blocks = [block[1].view(fmt.raw) for block in blocks]
        self.scale_blocks = [block[2].view(np.uint8) if fmt.blocked else None
                             for block in blocks]

    def reads(self, side: Backend) -> bool:
        """Only CPU lookups: the GPU cannot read the mapped files."""
        return side is HOST

    def write_rows(self, local_start: int, rows, scales=None) -> None:
        """Refused: the rows are the checkpoint's, mapped read-only."""
        raise ValueError("an mmap table serves the checkpoint's rows as they are: it is read-only")

    def gather(self, job: Gather) -> None:
        """Write the rows of ``job.ids`` into ``job.out``: every head, or with ``job.expected``
        (a finished prefetch already in ``out``) only the heads whose id differs from it."""
        if self.guard is not None:
            self.guard()
        flat = job.ids.reshape(-1)
        rows = job.out.reshape(-1, self.head_dim)
        where = (np.arange(flat.size) if job.expected is None
                 else np.flatnonzero(job.expected.reshape(-1) != flat))
        rows[where] = 0
        local = flat[where] - job.row_start
        owned = (local >= 0) & (local < self.num_rows)
        where, local = where[owned], local[owned]
        block = np.searchsorted(self.starts, local, side="right") - 1
        order = np.argsort(block, kind="stable")
        where, local, block = where[order], local[order], block[order]
        bounds = np.flatnonzero(np.diff(block, prepend=-1, append=len(self.blocks)))
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
            gathered = np.empty((hi - lo, self.head_dim), dtype=rows.dtype)
            gather_numba.gather_rows(
                self.blocks[block[lo]], self.format.code, int(self.starts[block[lo]]), job.scale,
                local[lo:hi].reshape(-1, 1), gathered, job.out_code,
                parallel=False if job.worker else None, scales=self.scale_blocks[block[lo]],
            )
            rows[where[lo:hi]] = gathered
