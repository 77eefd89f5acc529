"""Page prefetch for tables mapped from checkpoint files: ``madvise(MADV_WILLNEED)`` on the pages
of the rows a prefetch will read, on a thread of its own.

A lookup into a cold mapped table faults its pages in one at a time (the mapping is advised
``MADV_RANDOM``: no read-ahead). Told which pages come next, the kernel starts reading them all
at once, so the gather that follows (the CPU prefetch worker's, or the GPU's over UVA) finds
them arriving. The advice is a hint: it never changes a result, and ids it reads late (device
ids copied after the caller moved on) only make it less useful.
"""

from __future__ import annotations

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
MADV_WILLNEED = getattr(mmap, "MADV_WILLNEED", 3)


def madvise(address: int, length: int, advice: int = MADV_WILLNEED) -> None:
    """``madvise`` of a page-aligned range (a failure is ignored: it is advice)."""
    _LIBC.madvise(address, length, advice)


def page_runs(ids: np.ndarray, starts: np.ndarray, addresses: np.ndarray, row_bytes: int,
              num_rows: int, page: int = mmap.PAGESIZE) -> list[tuple[int, int]]:
    """``(address, length)`` page-aligned runs holding the rows ``ids`` (local; those outside
    ``[0, num_rows)`` are skipped) of blocks that start at local rows ``starts`` and host
    addresses ``addresses``; adjacent pages are merged into one run."""
    local = np.unique(ids[(ids >= 0) & (ids < num_rows)].astype(np.int64))
    if local.size == 0:
        return []
    block = np.searchsorted(starts, local, side="right") - 1
    first = addresses[block] + (local - starts[block]) * row_bytes
    low, high = first // page, (first + row_bytes - 1) // page
    counts = high - low + 1  # pages per row (more than two for rows over a page long)
    offsets = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    pages = np.unique(np.repeat(low, counts) + offsets)
    breaks = np.flatnonzero(np.diff(pages) != 1) + 1
    return [(int(run[0]) * page, (int(run[-1]) - int(run[0]) + 1) * page)
            for run in np.split(pages, breaks)]


class PagePrefetcher:
    """Advises the pages of rows about to be read, on a daemon thread fed by ``submit``.

    ``blocks``: the table's local row blocks (host arrays over mapped files), starting at local
    rows ``starts``. ``submit(ids, row_start)`` takes NumPy ids (copied), or CuPy ids with the
    caller's stream (an event recorded there orders the copy the thread makes, so the caller
    never waits).
    """

    def __init__(self, blocks: Sequence[np.ndarray], starts: np.ndarray, row_bytes: int,
                 num_rows: int):
        self.starts = np.asarray(starts, dtype=np.int64)
        self.addresses = np.array([block.ctypes.data for block in blocks], dtype=np.int64)
        self.row_bytes, self.num_rows = int(row_bytes), int(num_rows)
        self.requests: queue.SimpleQueue = queue.SimpleQueue()
        self.thread: threading.Thread | None = None
        self.advised = 0  # page runs advised so far

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
            for address, length in page_runs(ids.reshape(-1) - row_start, self.starts,
                                             self.addresses, self.row_bytes, self.num_rows):
                madvise(address, length)
                self.advised += 1

    def drain(self) -> None:
        """Wait until every request so far is advised (tests, benchmarks)."""
        if self.thread is not None:
            self.requests.put((None, 0, None))  # the thread ends after the requests before it
            self.thread.join()
            self.thread = None
