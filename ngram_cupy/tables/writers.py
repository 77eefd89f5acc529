"""A table's row writers (asynchronous optimizers): lookups wait for their pending updates, and a
lookup that joins a prefetch gathers again the heads whose rows were updated after it began."""

from __future__ import annotations

from typing import Any

import numpy as np


class Writers:
    """The update workers writing a table's rows, and the ids written since the last prefetch.

    A worker has ``wait()`` (until its pending update is applied, re-raising once an error the
    update raised) and ``settle()`` (the same wait, raising nothing: a prefetch's worker waits so,
    and the caller's next call reports the error).
    """

    def __init__(self) -> None:
        self.workers: list[Any] = []
        self.since_prefetch: list[np.ndarray] | None = None  # ids written since the prefetch

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

    def wrote(self, ids) -> None:
        """An update of the rows ``ids`` (global, any shape) was issued."""
        if self.since_prefetch is not None:
            self.since_prefetch.append(np.array(ids, np.int64).reshape(-1))

    def take(self) -> list[np.ndarray] | None:
        """The ids written since the last prefetch (None: none logged); the log restarts."""
        written, self.since_prefetch = self.since_prefetch, None
        return written or None


def regather_written(written: list[np.ndarray] | None, ids, expected):
    """``expected`` (the prefetched ids) with every head whose id an update written since the
    prefetch touched set to -1, so that the lookup gathers it again (GPU ids: None, all again)."""
    if written is None or expected is None:
        return expected
    if not isinstance(ids, np.ndarray):
        return None
    stale = np.isin(ids, np.concatenate(written))
    if not stale.any():
        return expected
    marked = np.array(expected, np.int64)
    marked[stale] = -1
    return marked
