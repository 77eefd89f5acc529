"""Page reads for tables mapped from checkpoint files: ``madvise(MADV_WILLNEED)`` on the pages
of the rows a gather will read: on a thread of its own for a prefetch of GPU ids, and before a
CPU gather (a lookup's, or a prefetch's on its worker) that finds its pages out of memory.

A lookup into a cold mapped table faults its pages in one at a time (the mapping is advised
``MADV_RANDOM``: no read-ahead). Told which pages come next, the kernel starts reading them all
at once, so the gather that follows (the CPU prefetch worker's, or the GPU's over UVA) finds
them arriving. A CPU gather first asks ``mincore`` about a sample of its rows' pages
(``resident_pages``) and advises them all only when one is out, so a warm table pays a few
system calls. The advice is a hint: it never changes a result, and ids it reads late (device
ids copied after the caller moved on) only make it less useful.
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
import queue
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..runtime.backends import cupy_module

_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
MINCORE = getattr(_LIBC, "mincore", None)  # None: residency unknown, lookups never advise
if MINCORE is not None:
    MINCORE.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    MINCORE.restype = ctypes.c_int
MADV_WILLNEED = getattr(mmap, "MADV_WILLNEED", 3)
ROWS_PER_SAMPLE = 256  # a lookup asks mincore about one page per this many rows ...
MAX_SAMPLE = 16  # ... and at most this many (a system call each)


def madvise(address: int, length: int, advice: int = MADV_WILLNEED) -> None:
    """``madvise`` of a page-aligned range (a failure is ignored: it is advice)."""
    _LIBC.madvise(address, length, advice)


def resident_pages(addresses: list[int]) -> list[bool] | None:
    """Whether each page at these page-aligned addresses is in memory (``mincore``), or None
    where that cannot be asked (no ``mincore``, or it fails)."""
    if MINCORE is None:
        return None
    state = ctypes.c_ubyte()
    found = []
    for address in addresses:
        if MINCORE(address, 1, ctypes.byref(state)) != 0:
            return None
        found.append(bool(state.value & 1))
    return found


def span_pages(first: np.ndarray, last: np.ndarray) -> np.ndarray:
    """Every page of the spans ``[first[i], last[i]]`` (page numbers, ``first`` not empty),
    sorted, each once."""
    counts = last - first + 1  # pages per span (more than two for rows over a page long)
    offsets = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    pages = np.sort(np.repeat(first, counts) + offsets)  # sorted, repeated pages
    return pages[np.diff(pages, prepend=pages[0] - 1) != 0]  # (np.unique is slower here)


def page_runs(ids: np.ndarray, starts: np.ndarray, addresses: np.ndarray, row_bytes: int,
              num_rows: int, page: int = mmap.PAGESIZE) -> list[tuple[int, int]]:
    """``(address, length)`` page-aligned runs holding the rows ``ids`` (local; those outside
    ``[0, num_rows)`` are skipped) of blocks that start at local rows ``starts`` and host
    addresses ``addresses``; adjacent pages are merged into one run."""
    local = ids[(ids >= 0) & (ids < num_rows)].astype(np.int64)
    if local.size == 0:
        return []
    block = np.searchsorted(starts, local, side="right") - 1
    first = addresses[block] + (local - starts[block]) * row_bytes
    pages = span_pages(first // page, (first + row_bytes - 1) // page)
    first = np.flatnonzero(np.diff(pages, prepend=pages[0] - 2) != 1)  # where each run starts
    lengths = np.diff(first, append=pages.size)
    return list(zip((pages[first] * page).tolist(), (lengths * page).tolist(), strict=True))


def block_addresses(blocks: Sequence[np.ndarray]) -> np.ndarray:
    """The host address of each block, as int64."""
    return np.array([block.ctypes.data for block in blocks], dtype=np.int64)


class PagePrefetcher:
    """Advises the pages of rows about to be read: on a daemon thread fed by ``submit``, or on
    the gathering thread with ``read_cold``.

    ``blocks``: the table's local row blocks (host arrays over mapped files), starting at local
    rows ``starts``; ``scale_blocks``: a block-scaled table's scale rows beside them (their pages
    are advised with the rows'). ``submit(ids, row_start)`` takes NumPy ids (copied), or CuPy ids
    with the caller's stream (an event recorded there orders the copy the thread makes, so the
    caller never waits).
    """

    def __init__(self, blocks: Sequence[np.ndarray], starts: np.ndarray, row_bytes: int,
                 num_rows: int, scale_blocks: Sequence[np.ndarray] | None = None):
        self.starts = np.asarray(starts, dtype=np.int64)
        self.addresses = block_addresses(blocks)
        self.row_bytes, self.num_rows = int(row_bytes), int(num_rows)
        self.block_starts, self.block_addresses = self.starts.tolist(), self.addresses.tolist()
        self.areas = [(self.addresses, self.row_bytes)]  # (block addresses, bytes per row)
        if scale_blocks:
            self.areas.append((block_addresses(scale_blocks), scale_blocks[0].shape[1]))
        self.requests: queue.SimpleQueue = queue.SimpleQueue()
        self.thread: threading.Thread | None = None
        self.advised = 0  # page runs advised so far
        self.cold_reads = 0  # lookups that found pages out of memory and advised them

    def advise(self, local: np.ndarray) -> None:
        """Advise every page holding the rows ``local`` (local ids; others are skipped) and
        their block scales."""
        for addresses, row_bytes in self.areas:
            for address, length in page_runs(local, self.starts, addresses, row_bytes,
                                             self.num_rows):
                madvise(address, length)
                self.advised += 1

    def sample_pages(self, local: np.ndarray) -> list[int]:
        """The first page of a spread sample of the rows ``local`` (local ids inside the
        table): one per ``ROWS_PER_SAMPLE`` rows, at most ``MAX_SAMPLE`` (Python integers: for
        so few rows, NumPy's per-call cost would be most of a small lookup's check)."""
        count = min(MAX_SAMPLE, 1 + local.size // ROWS_PER_SAMPLE)
        pages = []
        for row in local[:: max(1, local.size // count)][:count].tolist():
            block = bisect.bisect_right(self.block_starts, row) - 1
            first = self.block_addresses[block] + (row - self.block_starts[block]) * \
                self.row_bytes
            pages.append(first - first % mmap.PAGESIZE)
        return pages

    def read_cold(self, local: np.ndarray) -> bool:
        """Before a gather of the rows ``local`` (local ids, all inside the table): when a sample
        of their pages is not all in memory, advise every page now, so the kernel reads them at
        once instead of one fault at a time; whether it did. Where residency cannot be asked,
        nothing is advised."""
        if local.size == 0:
            return False
        resident = resident_pages(self.sample_pages(local))
        if resident is None or all(resident):
            return False
        self.advise(local)
        self.cold_reads += 1
        return True

    def submit(self, ids, row_start: int, stream: Any = None) -> None:
        """Queue the rows of ``ids`` (global) for advice."""
        if isinstance(ids, np.ndarray):
            self.requests.put((ids.copy(), row_start, None))
        else:  # copied on the caller's stream, read by the thread once the copy is done
            copy = ids.copy()
            self.requests.put((copy, row_start, stream.record()))
        if self.thread is None:
            self.thread = threading.Thread(target=self._serve, name="ngram-cupy-pages",
                                           daemon=True)
            self.thread.start()

    def _serve(self) -> None:
        """The thread: advise each request's pages, in order."""
        copies = None  # the thread's own stream for device ids
        while True:
            ids, row_start, event = self.requests.get()
            if ids is None:
                return
            if event is not None:
                if copies is None:
                    copies = cupy_module().cuda.Stream(non_blocking=True)
                event.synchronize()
                ids = ids.get(stream=copies)
            self.advise(ids.reshape(-1) - row_start)

    def drain(self) -> None:
        """Wait until every request so far is advised (tests, benchmarks)."""
        if self.thread is not None:
            self.requests.put((None, 0, None))  # the thread ends after the requests before it
            self.thread.join()
            self.thread = None
