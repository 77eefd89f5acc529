"""The prefetch protocol: start a gather early, join it at the next lookup.

A prefetch gathers into a staging buffer and remembers the ids it gathered; the next lookup
always joins it (the in-flight gather owns the staging buffer, even when other ids are asked for)
and then re-gathers only the heads whose ids differ. On the GPU the gather runs on a private CUDA
stream ordered by events, with no host synchronisation; on the CPU it runs on a worker thread.

Threads: a pending prefetch belongs to the thread that started it, and only that thread's
lookup joins it; other threads' lookups gather on their own meanwhile. Staging buffers are kept
per thread, so no thread's result is ever another's staging buffer. A table holds one pending
prefetch: another thread's prefetch while it is pending raises ``RuntimeError`` naming both
threads (give each thread its own table: tables over one weight array share its memory).

Staging buffers are kept per shape, the latest ``STAGING_SHAPES`` of them on each side: batch
sizes change from step to step. A CUDA graph holds the addresses of the buffers it captured, so a
graph user pins the batch sizes it captures with ``keep(num_tokens)`` (``EmbeddingTable.
keep_staging``) before capturing; pinned buffers are never dropped.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..runtime.backends import HOST, Backend, cupy_module, device_index

# Staging buffer shapes kept per side (beyond the pinned ones).
STAGING_SHAPES = 8


@dataclass
class Pending:
    """An issued prefetch: the ids it gathered (int64 copy) and the rows it writes."""

    ids: Any
    rows: Any
    out_code: int
    captured: bool = False  # issued inside a CUDA graph capture


class Buffers:
    """Arrays allocated once per (thread, role, shape, dtype), so their addresses stay put.

    ``keep`` bounds how many are kept, dropping the least recently used (it stays alive wherever
    it is still referenced); buffers whose first dimension was pinned with ``pin`` are never
    dropped nor counted. None keeps every one.
    """

    def __init__(self, empty: Callable[..., Any], keep: int | None = STAGING_SHAPES):
        self._empty = empty
        self._keep = keep
        self._arrays: OrderedDict[tuple, Any] = OrderedDict()
        self._pinned: OrderedDict[tuple, Any] = OrderedDict()
        self._pinned_sizes: set[int] = set()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._arrays) + len(self._pinned)

    def pin(self, sizes: Iterable[int]) -> None:
        """Keep every buffer whose first dimension is one of ``sizes``, now and later."""
        with self._lock:
            self._pinned_sizes.update(int(size) for size in sizes)
            for key in [key for key in self._arrays
                        if key[2][:1] and key[2][0] in self._pinned_sizes]:
                self._pinned[key] = self._arrays.pop(key)

    def get(self, role: str, shape: tuple[int, ...], dtype) -> Any:
        """The calling thread's buffer for this role, shape and dtype, allocated on first use
        (per thread: a result one thread still holds is never another's staging buffer)."""
        key = (threading.get_ident(), role, tuple(shape), str(dtype))
        with self._lock:
            if key in self._pinned:
                return self._pinned[key]
            if key in self._arrays:
                self._arrays.move_to_end(key)
                return self._arrays[key]
            array = self._empty(shape, dtype=dtype)
            if shape and shape[0] in self._pinned_sizes:
                self._pinned[key] = array
            else:
                self._arrays[key] = array
                if self._keep is not None and len(self._arrays) > self._keep:
                    self._arrays.popitem(last=False)
            return array


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

    def wait(self) -> None:
        """Wait for the issued gather without joining it (its rows stay pending)."""
        if self._future is not None and self._pid == os.getpid():
            self._future.exception()

    def join(self) -> Pending | None:
        """Wait for the issued prefetch, if any; its exception, if it raised, surfaces here.

        In a process forked while it ran, the gather's thread is not there: it is dropped (None).
        A prefetch another thread started is left pending for that thread (None). An id the
        prefetch refused is an IndexError that says so: the joining call may pass other ids.
        """
        with self._lock:
            if not _mine(self._owner) and self._pid == os.getpid():
                return None
            future, pending = self._future, self._pending
            self._future = self._pending = self._owner = None
        if future is None or self._pid != os.getpid():
            return None
        try:
            future.result()
        except IndexError as error:
            raise IndexError(f"the earlier prefetch of ids of shape {tuple(pending.ids.shape)}, "
                             f"joined by this call: {error}") from error
        return pending

    def close(self, wait: bool = True) -> None:
        """Stop the worker; an abandoned prefetch's result (or error) is dropped.

        ``wait=False`` (garbage collection) only tells the worker to exit after its gather:
        joining a thread from a finaliser can deadlock when the collection runs inside the
        start of another thread.
        """
        if wait:
            self.wait()
        self._future = self._pending = self._owner = None
        if self._executor is not None:
            self._executor.shutdown(wait=wait)
            self._executor = None


class StreamPrefetcher:
    """GPU prefetch: the gather runs on a private stream that first waits for an event recorded
    on the caller's stream; ``join`` makes the caller's stream wait for the gather's event.
    Nothing here waits on the host: ``start`` returns once the gather is queued.

    The ids snapshot of a shape is reused by the next prefetch of that shape, which may be
    issued on another stream than the lookup that read the snapshot (its re-gather):
    ``read_by`` records an event of that shape behind that lookup, and ``before_snapshot``
    makes the next prefetch of the shape wait for it before it overwrites the snapshot (one
    event per shape: a lookup of another shape in between does not replace it).

    A prefetch issued inside a CUDA graph capture must be joined (by its lookup) inside the same
    capture, and one issued outside cannot be joined inside one: either mismatch is a clear
    ``RuntimeError`` (CUDA would report an unjoined or isolated capture).
    """

    def __init__(self, stream: Any = None, event: Callable[[], Any] | None = None,
                 device: int | None = None) -> None:
        self.device = device  # the GPU of the stream and events: the tables' and ids' GPU
        cupy = cupy_module() if stream is None or event is None else None
        self._on_device = (lambda: cupy.cuda.Device(device)) if cupy is not None and \
            device is not None else contextlib.nullcontext
        with self._on_device():
            self.stream = cupy.cuda.Stream(non_blocking=True) if stream is None else stream
            self._event = event or (lambda: cupy.cuda.Event(disable_timing=True))
            self._ready, self._done = self._event(), self._event()
        # snapshot shape -> the stream of the last lookup that read it (None: nothing to wait
        # for) and the event recorded behind its reads
        self._reads: dict[tuple[int, ...], tuple[Any, Any]] = {}
        self._pending: Pending | None = None
        self._owner: int | None = None  # the thread that started the pending prefetch
        self._lock = threading.Lock()

    def start(self, caller, pending: Pending, gather: Callable[[], object]) -> None:
        """Enqueue ``gather`` on the private stream behind everything already on ``caller``."""
        with self._lock:
            if self._pending is not None:
                _refuse_second_prefetch(self._owner)
            pending.captured = caller.is_capturing()
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
        if pending is None:
            return None
        capturing = caller.is_capturing()
        if pending.captured and not capturing:
            raise RuntimeError(
                "a prefetch was captured in a CUDA graph without its lookup: capture the "
                "lookup that consumes it in the same graph (the capture itself fails as "
                "unjoined); the prefetch is dropped")
        if capturing and not pending.captured:
            raise RuntimeError(
                "a lookup captured in a CUDA graph cannot join a prefetch issued outside the "
                "capture: capture prefetch and lookup together; the prefetch is dropped")
        caller.wait_event(self._done)
        return pending

    def read_by(self, stream, shape: tuple[int, ...]) -> None:
        """A lookup on ``stream`` has queued its reads of the joined prefetch's snapshot of
        ``shape`` (in a capture nothing is recorded: a replay is ordered by its graph, and an
        event recorded in a capture cannot be waited for outside it)."""
        _, read = self._reads.get(shape, (None, None))
        if stream.is_capturing():
            self._reads[shape] = (None, read)
            return
        if read is None:
            with self._on_device():
                read = self._event()
        read.record(stream)
        self._reads[shape] = (stream, read)

    def before_snapshot(self, caller, shape: tuple[int, ...]) -> None:
        """Order ``caller`` (about to overwrite the snapshot of ``shape``) after the last lookup
        that read it, when that lookup ran on another stream; device-side, and not from inside
        a capture (a capturing stream cannot wait for work outside its capture)."""
        read_on, read = self._reads.get(shape, (None, None))
        if read_on is None:
            return
        self._reads[shape] = (None, read)
        if read_on.ptr != caller.ptr and not caller.is_capturing():
            caller.wait_event(read)  # else the same stream (already in order), or a capture

    def close(self) -> None:
        """Let the private stream drain: its gather may still read the table."""
        self._pending = self._owner = None
        self.stream.synchronize()


class Prefetcher:
    """A table's prefetch state on both sides: the worker thread, the private stream, and the
    staging buffers of each side."""

    def __init__(self) -> None:
        self.threads = ThreadPrefetcher()
        self.streams: StreamPrefetcher | None = None
        self._buffers: dict[tuple[Backend, int | None], Buffers] = {}
        self._keep: set[int] = set()

    def buffers(self, side: Backend, device: int | None = None) -> Buffers:
        """The staging buffers of one side (and GPU)."""
        key = (side, device)
        if key not in self._buffers:
            self._buffers[key] = Buffers(side.empty)
            self._buffers[key].pin(self._keep)
        return self._buffers[key]

    def keep(self, num_tokens: Iterable[int]) -> None:
        """Never drop the staging buffers of these batch sizes (CUDA graphs hold them)."""
        self._keep.update(int(n) for n in num_tokens)
        for buffers in self._buffers.values():
            buffers.pin(self._keep)

    def join(self, side: Backend, stream: Any) -> Pending | None:
        """Join the issued prefetch of ``side``, if any (it owns the staging buffers)."""
        if side is HOST:
            return self.threads.join()
        return None if self.streams is None else self.streams.join(stream)

    def issue(self, side: Backend, stream: Any, ids, rows_shape: tuple[int, int], rows_dtype,
              out_code: int, out, gather: Callable[[Any, Any, bool], object]) -> None:
        """Join the previous prefetch, snapshot ``ids`` and start ``gather(ids, rows, worker)``
        into ``out`` (or a staging buffer), on the worker thread or the private stream (on the
        ids' GPU, whichever device is current)."""
        device = None if side is HOST else device_index(ids)
        buffers = self.buffers(side, device)
        self.join(side, stream)
        if side is not HOST and self.streams is not None:
            self.streams.before_snapshot(stream, ids.shape)
        snapshot = buffers.get("ids", ids.shape, np.int64)
        snapshot[...] = ids
        rows = out if out is not None else buffers.get("rows", rows_shape, rows_dtype)
        pending = Pending(snapshot, rows, out_code)
        if side is HOST:
            self.threads.start(pending, lambda: gather(snapshot, rows, True))
        else:
            if self.streams is not None and self.streams.device != device:
                self.streams.close()  # joined above: a table read from another GPU now
                self.streams = None
            if self.streams is None:
                self.streams = StreamPrefetcher(device=device)
            self.streams.start(stream, pending, lambda: gather(snapshot, rows, False))

    def finish(self, side: Backend, stream: Any, ids, out_code: int, out,
               gather: Callable[[Any, Any, Any], object]):
        """Join the prefetch of ``side``; when it gathered ids of this shape and output format,
        complete its rows (into ``out`` when given) with ``gather(ids, target, expected)`` for
        the heads whose ids changed, and return them; else None."""
        pending = self.join(side, stream)
        if pending is None or pending.ids.shape != ids.shape or pending.out_code != out_code:
            return None
        target = pending.rows if out is None else out
        if side.address(target) != side.address(pending.rows):
            target[...] = pending.rows
        gather(ids, target, pending.ids)
        if side is not HOST:
            self.streams.read_by(stream, ids.shape)  # the next prefetch of the shape waits
        return target

    def close(self, wait: bool = True) -> None:
        """Finish and stop both prefetchers (see ``ThreadPrefetcher.close``)."""
        if self.streams is not None and wait:
            self.streams.close()
            self.streams = None
        self.threads.close(wait)
