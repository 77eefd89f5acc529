"""Rows served straight from memory-mapped checkpoint shards, for tables larger than RAM.

The rows stay in the files (mapped with ``madvise(MADV_RANDOM)``, so a lookup faults in only the
pages it reads, without read-ahead); nothing is loaded up front. Shards can live in different
files, so the rows are a sequence of contiguous blocks, each a read-only mapped view; the gather
groups the ids by block and runs the CPU gather (``gather_numba``) on each. A CPU gather (a
lookup's, or a prefetch's on its worker) whose rows are out of memory first has all their pages
read at once (``PagePrefetcher.read_cold``), not faulted in one by one.

Where the GPU can read pageable host memory (``cudaDevAttrPageableMemoryAccess``: HMM or ATS),
GPU lookups read the mapped pages too, with the UVA gather kernel (``gather_cupy``): no load, no
pinned copy, the page cache shared by every process. A prefetch of GPU ids first advises the
pages of its rows ``MADV_WILLNEED`` on a thread of its own (``memory.page_reads``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from ...formats import Format
from ...memory.page_reads import PagePrefetcher
from ...runtime.backends import DEVICE, HOST, Backend, cupy_module, gpu_available
from .. import gather_numba
from .base import Gather, Storage, owned_positions, placement_list
from .gpu import gather_device

PAGEABLE_MEMORY_ACCESS = 88  # cudaDevAttrPageableMemoryAccess
NO_PAGEABLE_ACCESS = (
    "this table (placement='mmap') is read by the GPU only where the device reports "
    "cudaDevAttrPageableMemoryAccess (HMM or ATS), and this one does not: pass NumPy / CPU ids, "
    "or place it on " + placement_list("gpu", "pinned", "shared"))


def gpu_reads_pageable(get_attribute: Callable[[int, int], int] | None = None,
                       device: int | None = None) -> bool:
    """Whether the GPU reads pageable host memory (mapped files included) at its host address:
    ``cudaDevAttrPageableMemoryAccess`` of ``device`` (default: the current one), asked through
    ``get_attribute(attribute, device)`` (default: CuPy's; no GPU: False)."""
    if get_attribute is None:
        if not gpu_available():
            return False
        runtime = cupy_module().cuda.runtime
        get_attribute = runtime.deviceGetAttribute
        device = runtime.getDevice() if device is None else device
    return bool(get_attribute(PAGEABLE_MEMORY_ACCESS, 0 if device is None else int(device)))


def device_block(rows: np.ndarray, raw) -> object:
    """A CuPy array over a mapped host block at its host address (read through HMM / ATS)."""
    cupy = cupy_module()
    memory = cupy.cuda.UnownedMemory(rows.ctypes.data, rows.nbytes, rows,
                                     cupy.cuda.runtime.getDevice())
    return cupy.ndarray(rows.shape, raw, cupy.cuda.MemoryPointer(memory, 0))


class MappedStorage(Storage):
    """Local rows ``[0, sum of block rows)`` as read-only mapped blocks, read on the CPU.

    ``blocks``: ``(first local row, raw-or-typed rows)`` pairs tiling the rows in order (a
    block-scaled format's: ``(first local row, packed rows, block scales)``); ``guard``, called
    before every gather, raises if the files behind them changed (a read past a shrunk file's
    end is a SIGBUS, not an exception). ``pageable``: whether the GPU can read the mapped pages
    (default: ``gpu_reads_pageable()``).
    """

    placement = "mmap"
    writable = False
    serves_after_close = False  # detached / unmapped: a closed table refuses lookups

    def __init__(self, blocks: Sequence[tuple], head_dim: int, fmt: Format,
                 guard: Callable[[], None] | None = None, pageable: bool | None = None):
        super().__init__(sum(block[1].shape[0] for block in blocks), head_dim, fmt)
        self.guard = guard
        self.starts = np.array([block[0] for block in blocks], dtype=np.int64)
        self.blocks = [block[1].view(fmt.raw) for block in blocks]
        self.scale_blocks = [block[2].view(np.uint8) if fmt.blocked else None
                             for block in blocks]
        self.pageable = gpu_reads_pageable() if pageable is None else bool(pageable)
        self.device_blocks = None
        self.pages = PagePrefetcher(self.blocks, self.starts,
                                    fmt.row_width(head_dim) * fmt.itemsize, self.num_rows,
                                    self.scale_blocks if fmt.blocked else None)

    def reads(self, side: Backend) -> bool:
        """CPU lookups; GPU ones where the device reads pageable memory."""
        return side is HOST or self.pageable

    def refusal(self, side: Backend) -> str | None:
        """Why GPU ids cannot read this table (the device attribute it lacks)."""
        return None if self.reads(side) else NO_PAGEABLE_ACCESS

    def training_refusal(self) -> str | None:
        """The rows are the checkpoint files' pages, mapped read-only."""
        return ("placement='mmap' tables are read-only (the rows are the checkpoint files' "
                f"pages): load the table into {placement_list('cpu', 'pinned', 'shared')} memory "
                "to train it")

    def will_read(self, ids, row_start: int, stream=None) -> None:
        """GPU ids: advise the pages of these rows ``MADV_WILLNEED``, off the caller's thread.
        CPU ids: nothing here; the prefetch's worker reads the cold pages before its gather,
        which is faster than advice racing the gather's own faults."""
        if not isinstance(ids, np.ndarray):
            self.pages.submit(ids, row_start, stream)

    def write_rows(self, local_start: int, rows, scales=None) -> None:
        """Refused: the rows are the checkpoint's, mapped read-only."""
        raise ValueError("an mmap table serves the checkpoint's rows as they are: it is read-only")

    def gather(self, job: Gather) -> None:
        """Write the rows of ``job.ids`` into ``job.out``: every head, or with ``job.expected``
        (a finished prefetch already in ``out``) only the heads whose id differs from it."""
        if self.guard is not None:
            self.guard()
        if job.side is DEVICE:
            self.gather_device(job)
            return
        rows = job.out.reshape(-1, self.head_dim)
        where, local = owned_positions(job, self.num_rows)
        self.pages.read_cold(local)
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

    def gather_device(self, job: Gather) -> None:
        """The UVA gather over the mapped blocks: one block directly; several, each into a zeroed
        buffer (ids of other blocks give zero rows), merged by OR of the bits, which is exact."""
        if self.device_blocks is None:
            self.device_blocks = [
                (device_block(rows, self.format.raw),
                 None if scales is None else device_block(scales, np.uint8))
                for rows, scales in zip(self.blocks, self.scale_blocks, strict=True)]
        if len(self.device_blocks) == 1:
            rows, scales = self.device_blocks[0]
            gather_device(rows, self.format.code, job, scales)
            return
        cupy = cupy_module()
        with job.stream:
            merged = cupy.zeros_like(job.out)
            part = cupy.empty_like(job.out)
        for start, (rows, scales) in zip(self.starts, self.device_blocks, strict=True):
            gather_device(rows, self.format.code, dataclasses.replace(
                job, out=part, row_start=job.row_start + int(start), expected=None, dedup=False),
                scales)
            with job.stream:
                merged |= part
        with job.stream:
            job.out[...] = merged

    def close(self) -> None:
        """Stop the page prefetcher after the advice already asked for."""
        self.pages.drain()
