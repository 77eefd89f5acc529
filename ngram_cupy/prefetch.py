"""The prefetch protocol: start a gather early, join it at the next lookup.

A prefetch gathers into a staging buffer and remembers the ids it gathered; ``lookup`` always
joins it (the in-flight gather owns the staging buffer, even when other ids are asked for) and
then re-gathers only the heads whose ids differ. On the GPU the gather runs on a private CUDA
stream ordered by events, with no host synchronisation; on the CPU it runs on a worker thread.
"""

from __future__ import annotations

import os
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

    def get(self, role: str, shape: tuple[int, ...], dtype) -> Any:
        """The buffer for this role, shape and dtype, allocated on first use."""
        key = (role, tuple(shape), str(dtype))
        if key in self._arrays:
            self._arrays.move_to_end(key)
        else:
            self._arrays[key] = self._empty(shape, dtype=dtype)
            if self._keep is not None and len(self._arrays) > self._keep:
                self._arrays.popitem(last=False)  # still alive wherever it is referenced
        return self._arrays[key]


class ThreadPrefetcher:
    """CPU prefetch: one worker thread runs the gather (Numba releases the GIL) while the caller
    goes on; ``join`` waits for it and re-raises whatever it raised."""

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None
        self._pid = os.getpid()  # the process whose thread the executor's is
        self._future: Future | None = None
        self._pending: Pending | None = None

    def start(self, pending: Pending, gather: Callable[[], object]) -> None:
        """Run ``gather`` on the worker; the caller has joined the previous prefetch."""
        if self._executor is None or self._pid != os.getpid():  # a forked child has no worker
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ngram-prefetch")
            self._pid = os.getpid()
        self._pending = pending
        self._future = self._executor.submit(gather)

    def join(self) -> Pending | None:
        """Wait for the issued prefetch, if any; its exception, if it raised, surfaces here.

        In a process forked while it ran, the gather's thread is not there: it is dropped (None).
        """
        future, pending = self._future, self._pending
        self._future = self._pending = None
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
        self._future = self._pending = None
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

    def start(self, caller, pending: Pending, gather: Callable[[], object]) -> None:
        """Enqueue ``gather`` on the private stream behind everything already on ``caller``."""
        self._ready.record(caller)
        self.stream.wait_event(self._ready)
        with self.stream:
            gather()
        self._done.record(self.stream)
        self._pending = pending

    def join(self, caller) -> Pending | None:
        """Order ``caller`` after the issued prefetch, if any (device-side: no host wait)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            caller.wait_event(self._done)
        return pending

    def close(self) -> None:
        """Let the private stream drain: its gather may still read the table."""
        self._pending = None
        self.stream.synchronize()
