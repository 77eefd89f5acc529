"""A table's row writers (asynchronous optimizers): lookups wait for their pending updates, and a
lookup that joins a prefetch gathers again the heads whose rows were updated after it began."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..runtime.backends import cupy_module


class Writers:
    """The update workers writing a table's rows, and the ids written since the last prefetch.

    A worker has ``wait()`` (until its pending update is applied, re-raising once an error the
    update raised) and ``settle()`` (the same wait, raising nothing: a prefetch's worker waits so,
    and the caller's next call reports the error).
    """

    def __init__(self) -> None:
        self.workers: list[Any] = []
        self.since_prefetch: list | None = None  # rows written since the prefetch began

    def wait(self) -> None:
        """Wait for every pending update; an error one raised surfaces here (once)."""
        for worker in list(self.workers):
            worker.wait()

    def settle(self) -> None:
        """Wait for every pending update without raising (their errors stay for the caller)."""
        for worker in list(self.workers):
            worker.settle()

    def prefetching(self) -> None:
        """A prefetch starts: it sees the updates issued so far; later ones are logged."""
        self.since_prefetch = []

    def wrote(self, rows) -> None:
        """Rows were written or an update of them issued: ``(start, stop)`` global rows, or
        global row ids (any shape, host or GPU), copied."""
        if self.since_prefetch is not None:
            self.since_prefetch.append(rows if isinstance(rows, tuple) else rows.reshape(-1).copy())

    def take(self) -> list | None:
        """The ids written since the last prefetch (None: none logged); the log restarts."""
        written, self.since_prefetch = self.since_prefetch, None
        return written or None


def regather_written(written: list | None, expected):
    """``expected`` (a finished prefetch's ids, host or GPU) with every head reading a row
    written since the prefetch began set to -1, never a row, so that the lookup gathers it
    again."""
    if not written or expected is None:
        return expected
    xp = np if isinstance(expected, np.ndarray) else cupy_module()
    stale = xp.zeros(expected.shape, bool)
    for rows in written:
        if isinstance(rows, tuple):
            stale |= (expected >= rows[0]) & (expected < rows[1])
        else:
            stale |= xp.isin(expected, xp.asarray(rows))
    marked = expected.copy()
    marked[stale] = -1
    return marked
