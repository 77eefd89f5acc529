"""Rows read straight from the checkpoint's safetensors files per lookup: ``placement="disk"``.

Nothing is loaded and nothing is mapped: a lookup takes its distinct rows, serves those the row
cache holds (``row_cache``: seeded hot rows, then recently read rows, within ``cache_bytes``),
and reads the pages the others touch from the files around the page cache, each page once (per
chunk of ``CHUNK_ROWS`` rows, which bounds the page buffer), up to ``DEPTH`` reads in flight
(``memory.direct_reads``: ``O_DIRECT`` and Linux AIO). A block-scaled row's bytes and its block
scales (two tensors of the checkpoint) are read in the same batch and staged as one record per
row (``codecs.records``), which the cache keeps and the CPU gather (``gather_numba``, the
kernels ``placement="cpu"`` uses) reads whole, so the bytes equal a CPU table's.

GPU ids are copied to the host, their rows gathered into page-locked staging and copied into
the lookup's output on its stream (``disk_staging``; see docs/disk.md for what a CUDA graph
replays). ``close()`` closes the files and the AIO context and releases the staging.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from ...codecs.records import record_bytes, record_views
from ...formats import Format
from ...memory.direct_reads import PAGE, AioContext, DirectFile, aligned_buffer, page_runs
from ...runtime.backends import DEVICE, Backend
from .. import gather_numba
from ..row_cache import DEFAULT_POLICY, RowCache
from .base import Gather, Storage, closed_table_error, owned_positions, placement_list
from .disk_staging import gather_staged

FILE_BITS = 40  # pages of file i are keyed i << FILE_BITS | page: runs never cross files
CHUNK_ROWS = 16_384  # rows read at once: at most 64 MiB of pages for rows of under a page


class DiskBlock(NamedTuple):
    """Local rows ``[start, start + rows)`` at byte ``offset`` of the file ``path`` (open as
    descriptor ``fd``, or None: opened by path), their block scales at ``scale_offset`` of the
    same file (block-scaled formats; else None)."""

    start: int
    rows: int
    path: str
    offset: int
    scale_offset: int | None = None
    fd: int | None = None
    scale_path: str | None = None
    scale_fd: int | None = None


class DiskStorage(Storage):
    """A table's local rows in checkpoint files, read per lookup (see the module docstring).

    ``blocks``: ``DiskBlock``s tiling the rows in order; ``guard``, called before each gather,
    raises an OSError when the files changed (``Checkpoint.check_files``); ``cache_bytes`` and
    ``cache_policy``: the row cache (``row_cache``)."""

    placement = "disk"
    writable = False
    serves_after_close = False

    def __init__(self, blocks: Sequence[DiskBlock], head_dim: int, fmt: Format,
                 guard: Callable[[], None] | None = None, cache_bytes: int = 0,
                 cache_policy: str = DEFAULT_POLICY):
        super().__init__(sum(block.rows for block in blocks), head_dim, fmt)
        self.guard = guard
        self.width = fmt.row_width(head_dim) * fmt.itemsize  # row bytes in the file
        self.scale_width = fmt.scale_width(head_dim) if fmt.blocked else 0
        self.record = record_bytes(fmt, head_dim)
        self.cache = RowCache(self.record, cache_bytes, cache_policy, max_rows=self.num_rows)
        self.files: list[DirectFile] = []
        opened: dict[str, int] = {}

        def file_of(path: str, fd: int | None) -> int:
            if path not in opened:
                opened[path] = len(self.files)
                self.files.append(DirectFile(path, None if fd is None else
                                             f"/proc/self/fd/{fd}"))
            return opened[path]

        self.aio = AioContext()
        self.starts = np.array([block.start for block in blocks], np.int64)
        self.row_file = np.array([file_of(b.path, b.fd) for b in blocks], np.int64)
        self.offsets = np.array([block.offset for block in blocks], np.int64)
        self.scale_file = np.array([file_of(b.scale_path or b.path, b.scale_fd or b.fd)
                                    if b.scale_offset is not None else 0 for b in blocks],
                                   np.int64)
        self.scale_offsets = np.array([block.scale_offset or 0 for block in blocks], np.int64)
        self.buffer = aligned_buffer(0)  # the page buffer, grown as lookups need
        self.staging = None  # GPU ids: page-locked staging (``disk_staging``)
        self.closed = False
        self.lock = threading.Lock()
        self.release = weakref.finalize(self, release, self.files, self.aio)

    def refusal(self, side: Backend) -> str | None:
        """None (GPU ids are staged through the host) until closed."""
        return str(closed_table_error(self.placement)) if self.closed else None

    def reads(self, side: Backend) -> bool:
        """CPU and GPU ids alike."""
        return not self.closed

    def training_refusal(self) -> str | None:
        """The rows are the checkpoint's, read from its files."""
        return ("placement='disk' tables are read-only (the rows are read from the checkpoint's "
                f"files): load the table into {placement_list('cpu', 'pinned', 'shared')} memory "
                "to train it")

    def write_rows(self, local_start: int, rows, scales=None) -> None:
        """Refused: the rows are the checkpoint's."""
        raise ValueError("a disk table serves the checkpoint's rows as they are: it is read-only")

    def cache_stats(self) -> dict:
        """The row cache's counters (``RowCache.stats``)."""
        return self.cache.stats()

    def seed_cache(self, local_rows: np.ndarray) -> None:
        """Read these local rows once and keep them in the cache for good (hot rows from corpus
        statistics), within ``cache_bytes``."""
        rows = np.unique(np.asarray(local_rows, np.int64))
        rows = rows[(rows >= 0) & (rows < self.num_rows)]
        records = np.zeros((rows.size, self.record), np.uint8)
        with self.lock:
            self.check_open()
            self.read_disk(rows, records, counted=False)
            self.cache.seed(rows, records)

    def records_of(self, rows: np.ndarray) -> np.ndarray:
        """The records ``[n, record]`` of local rows (sorted, unique): the cache's, the rest
        read from the files and kept in the cache."""
        records = np.empty((rows.size, self.record), np.uint8)  # every row is written below
        with self.lock:  # GPU lookups read on CUDA's host-function thread; close waits
            self.check_open()  # closed by another thread since the gather began
            missed = self.cache.find(rows, records)
            if missed.size:
                read = np.zeros((missed.size, self.record), np.uint8)  # padding zero
                self.read_disk(rows[missed], read)
                records[missed] = read
                self.cache.insert(rows[missed], read)
        return records

    def spans(self, rows: np.ndarray, files: np.ndarray, offsets: np.ndarray,
              width: int) -> tuple[np.ndarray, np.ndarray]:
        """``(first page key, last page key)`` of each row's ``width`` bytes, and their byte
        within the first page: keys are ``file << FILE_BITS | page``."""
        block = np.searchsorted(self.starts, rows, side="right") - 1
        byte = offsets[block] + (rows - self.starts[block]) * width
        base = files[block] << FILE_BITS
        return base + byte // PAGE, base + (byte + width - 1) // PAGE, byte % PAGE

    def read_disk(self, rows: np.ndarray, out: np.ndarray, counted: bool = True) -> None:
        """Read local rows (sorted, unique) into records ``out``, ``CHUNK_ROWS`` at a time (the
        page buffer holds one chunk's pages); ``counted``: in the cache's disk tier (lookups'
        reads; seeding is not)."""
        for start in range(0, rows.size, CHUNK_ROWS):
            self.read_chunk(rows[start:start + CHUNK_ROWS], out[start:start + CHUNK_ROWS],
                            counted)

    def read_chunk(self, rows: np.ndarray, out: np.ndarray, counted: bool) -> None:
        """Read local rows (sorted, unique) into records ``out``: the pages they touch (block
        scales included), each once, then each row's bytes out of them."""
        parts = [(self.row_file, self.offsets, self.width, 0)]
        if self.scale_width:
            parts.append((self.scale_file, self.scale_offsets, self.scale_width, self.width))
        spans = [self.spans(rows, files, offsets, width) for files, offsets, width, _ in parts]
        starts, counts = page_runs(np.concatenate([s[0] for s in spans]),
                                   np.concatenate([s[1] for s in spans]))
        at = np.concatenate([[0], np.cumsum(counts)[:-1]]) * PAGE
        buffer = self.page_buffer(int(counts.sum()) * PAGE)
        self.aio.read(self.files, starts >> FILE_BITS, (starts & ((1 << FILE_BITS) - 1)) * PAGE,
                      counts * PAGE, buffer, at)
        for (_, _, width, column), (first, _, within) in zip(parts, spans, strict=True):
            run = np.searchsorted(starts, first, side="right") - 1
            where = at[run] + (first - starts[run]) * PAGE + within
            out[:, column:column + width] = buffer[where[:, None] + np.arange(width)]
        if counted:
            self.cache.read_from_disk(rows.size, starts.size, int(counts.sum()),
                                      int(counts.sum()) * PAGE)

    def page_buffer(self, nbytes: int) -> np.ndarray:
        """The aligned page buffer, grown to ``nbytes`` (at least doubling) when smaller."""
        if self.buffer.size < nbytes:
            self.buffer = aligned_buffer(max(nbytes, 2 * self.buffer.size))
        return self.buffer

    def check_open(self) -> None:
        """The closed table's ValueError once closed (its files are released)."""
        if self.closed:
            raise closed_table_error(self.placement)

    def gather(self, job: Gather) -> None:
        """Write the rows of ``job.ids`` into ``job.out``: every head, or with ``job.expected``
        only the heads whose id differs from it. GPU ids through page-locked staging."""
        self.check_open()
        if self.staging is not None:  # a GPU lookup's failed read: raised on either side
            self.staging.raise_error()
        guard = self.guard  # None once closed by another thread
        if guard is not None:
            guard()
        if job.side is DEVICE:
            self.used_on(job.stream)
            gather_staged(self, job)
            return
        local = job.ids.reshape(-1) - job.row_start
        if job.expected is None and local.size and local.min() >= 0 \
                and local.max() < self.num_rows:  # every id this shard's: straight into out
            distinct, inverse = np.unique(local, return_inverse=True)
            self.gather_records(job, self.records_of(distinct), inverse.reshape(job.ids.shape),
                                job.out)
            return
        rows = job.out.reshape(-1, self.head_dim)
        where, local = owned_positions(job, self.num_rows)
        distinct, inverse = np.unique(local, return_inverse=True)
        gathered = np.empty((where.size, self.head_dim), dtype=rows.dtype)
        self.gather_records(job, self.records_of(distinct), inverse.reshape(-1, 1), gathered)
        rows[where] = gathered

    def gather_records(self, job: Gather, records: np.ndarray, slots: np.ndarray,
                       out: np.ndarray) -> None:
        """The CPU gather (``placement="cpu"``'s kernels) of ``records[slots]`` into ``out``."""
        table, scales = record_views(records, self.format, self.head_dim, raw=True)
        blocked = self.format.blocked
        gather_numba.gather_rows(
            table if blocked else records.view(self.format.raw), self.format.code, 0,
            job.scale, slots, out, job.out_code, parallel=False if job.worker else None,
            scales=scales if blocked else None, records=records if blocked else None)

    def raise_pending(self) -> None:
        """Wait for the GPU lookups still reading rows (not while one of their streams is
        capturing a graph), then raise (once) the failure one met."""
        if self.staging is None:
            return
        if not self.readers.capturing():
            self.readers.synchronize()
        self.staging.raise_error()

    def close(self) -> None:
        """Close the files and the AIO context, release the page buffer, the row cache, the
        staging and the guard (and with it the checkpoint's descriptors, once nothing else
        holds that checkpoint)."""
        with self.lock:  # after the reads in flight; a lookup that was waiting then refuses
            if self.closed:
                return
            self.closed = True
            self.release()
            self.guard = None  # it holds the checkpoint's descriptors
            self.cache.release()
            self.buffer = aligned_buffer(0)
        if self.staging is not None:
            self.staging.close()
            self.staging = None


def release(files: list[DirectFile], aio: AioContext) -> None:
    """Close a disk table's files and AIO context (``close``, or garbage collection)."""
    for file in files:
        file.close()
    aio.close()
