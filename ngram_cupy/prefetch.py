"""The prefetch protocol: start a gather early, join it at the next lookup.

A prefetch gathers into a staging buffer and remembers the ids it gathered; ``lookup`` always
joins it (the in-flight gather owns the staging buffer, even when other ids are asked for) and
then re-gathers only the heads whose ids differ. On the GPU the gather runs on a private CUDA
stream ordered by events, with no host synchronisation; on the CPU it runs on a worker thread.

Threads: a pending prefetch belongs to the thread that started it, and only that thread's
lookup joins it; other threads' lookups gather on their own meanwhile. Staging buffers are kept
per thread, so no thread's result is ever another's staging buffer. A table holds one pending
prefetch: another thread's prefetch while it is pending raises ``RuntimeError`` naming both
threads (give each thread its own table: tables over one weight array share its memory).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any


@dataclass
class Pending:
    """An issued prefetch: the ids it gathered (int64 copy) and the rows it writes."""

    ids: Any
    rows: Any
    out_code: int


class Buffers:
    """Arrays allocated once per (role, shape, dtype): their addresses stay put, so CUDA graphs
    captured over them replay correctly.

    ``keep`` bounds how many are kept, dropping the least recently used: only for host memory,
    which no graph can hold (a batch size per step would otherwise keep a buffer per size ever
    seen); None keeps every one.
    """

    def __init__(self, empty: Callable[..., Any], keep: int | None = None):
        self._empty = empty
        self._keep = keep
        self._arrays: OrderedDict[tuple, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, role: str, shape: tuple[int, ...], dtype) -> Any:
        """The calling thread's buffer for this role, shape and dtype, allocated on first use
        (per thread: a result one thread still holds is never another's staging buffer)."""
        key = (threading.get_ident(), role, tuple(shape), str(dtype))
        with self._lock:
            if key in self._arrays:
                self._arrays.move_to_end(key)
            else:
                self._arrays[key] = self._empty(shape, dtype=dtype)
                if self._keep is not None and len(self._arrays) > self._keep:
                    self._arrays.popitem(last=False)  # still alive wherever it is referenced
            return self._arrays[key]


def _refuse_second_prefetch(owner: int | None) -> None:
    """A table holds one pending prefetch: refuse another thread's while one is pending."""
    if owner is not None and owner != threading.get_ident():
        raise RuntimeError(
            f"prefetch from thread {threading.get_ident()}: a prefetch started by thread "
            f"{owner} is pending on this table, which holds one pending prefetch at a time. "
            "Give each thread its own EmbeddingTable / NGramEmbedding (tables over one weight "
            "array share its memory)"
        )


def _mine(owner: int | None) -> bool:
    """Whether the pending prefetch (if any) was started by the calling thread."""
    return owner is None or owner == threading.get_ident()


class ThreadPrefetcher:
    """CPU prefetch: one worker thread runs the gather (Numba releases the GIL) while the caller
    goes on; ``join`` waits for it and re-raises whatever it raised."""

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None
        self._pid = os.getpid()  # the process whose thread the executor's is
        self._future: Future | None = None
        self._pending: Pending | None = None
        self._owner: int | None = None  # the thread that started the pending prefetch
        self._lock = threading.Lock()

    def start(self, pending: Pending, gather: Callable[[], object]) -> None:
        """Run ``gather`` on the worker; the caller has joined the previous prefetch."""
        with self._lock:
            if self._future is not None:
                _refuse_second_prefetch(self._owner)
            if self._executor is None or self._pid != os.getpid():  # a forked child: no worker
                self._executor = ThreadPoolExecutor(max_workers=1,
                                                    thread_name_prefix="ngram-prefetch")
                self._pid = os.getpid()
            self._pending = pending
            self._owner = threading.get_ident()
            self._future = self._executor.submit(gather)

    def join(self) -> Pending | None:
        """Wait for the issued prefetch, if any; its exception, if it raised, surfaces here.

        In a process forked while it ran, the gather's thread is not there: it is dropped (None).
        A prefetch another thread started is left pending for that thread (None).
        """
        with self._lock:
            if not _mine(self._owner) and self._pid == os.getpid():
                return None
            future, pending = self._future, self._pending
            self._future = self._pending = self._owner = None
        if future is None or self._pid != os.getpid():
            return None
        future.result()
        return pending

    def close(self, wait: bool = True) -> None:
        """Stop the worker; an abandoned prefetch's result (or error) is dropped.

        ``wait=False`` (garbage collection) only tells the worker to exit after its gather:
        joining a thread from a finaliser can deadlock when the collection runs inside the
        start of another thread.
        """
        if wait and self._future is not None and self._pid == os.getpid():
            self._future.exception()
        self._future = self._pending = self._owner = None
        if self._executor is not None:
            self._executor.shutdown(wait=wait)
            self._executor = None


class StreamPrefetcher:
    """GPU prefetch: the gather runs on a private stream that first waits for an event recorded
    on the caller's stream; ``join`` makes the caller's stream wait for the gather's event."""

    def __init__(self) -> None:
        import cupy

        self.stream = cupy.cuda.Stream(non_blocking=True)
        self._ready = cupy.cuda.Event(disable_timing=True)
        self._done = cupy.cuda.Event(disable_timing=True)
        self._pending: Pending | None = None
        self._owner: int | None = None  # the thread that started the pending prefetch
        self._lock = threading.Lock()

    def start(self, caller, pending: Pending, gather: Callable[[], object]) -> None:
        """Enqueue ``gather`` on the private stream behind everything already on ``caller``."""
        with self._lock:
            if self._pending is not None:
                _refuse_second_prefetch(self._owner)
            self._ready.record(caller)
            self.stream.wait_event(self._ready)
            with self.stream:
                gather()
            self._done.record(self.stream)
            self._pending = pending
            self._owner = threading.get_ident()

    def join(self, caller) -> Pending | None:
        """Order ``caller`` after the issued prefetch, if any (device-side: no host wait); one
        another thread started is left pending for that thread (None)."""
        with self._lock:
            if not _mine(self._owner):
                return None
            pending, self._pending, self._owner = self._pending, None, None
        if pending is not None:
            caller.wait_event(self._done)
        return pending

    def close(self) -> None:
        """Let the private stream drain: its gather may still read the table."""
        self._pending = self._owner = None
        self.stream.synchronize()
