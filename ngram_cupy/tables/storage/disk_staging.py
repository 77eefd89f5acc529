"""GPU ids on a disk table: rows staged through page-locked host buffers, all in stream order.

A GPU lookup of a disk table enqueues three steps on its stream and returns at once (no host
wait): the ids are copied into a page-locked buffer, a host function (``runtime.host_functions``)
reads their rows (row cache, then the files) and gathers them into a page-locked rows buffer,
and that buffer is copied into the lookup's output. On a prefetch's private stream the reads
thus run while the caller's stream computes the previous layer; the join waits only for what
is left.

The buffers are kept per stream, role and shape, at fixed addresses: the latest ``KEPT`` of them
(batch sizes change from step to step; one dropped is freed once its stream passed it), and
until the table is closed every one a CUDA graph capture used (a graph that captured a lookup
replays the same three steps, reading the replay's ids and their rows then). Nothing is
allocated inside a capture: a shape first seen while capturing is a RuntimeError (look up one
batch of each captured shape outside the capture first). A failure in the host function (an
I/O error, a changed file) cannot raise there: the rows are set to NaN bits (all ones) and the
error is raised by the table's next lookup or ``check()`` (docs/disk.md).
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections import OrderedDict

import numpy as np

from ...runtime import host_functions
from ...runtime.backends import HOST, cupy_module
from ..prefetch import STAGING_SHAPES
from .base import Gather

ROLES = ("ids", "rows", "expected")  # the buffers of one lookup
KEPT = STAGING_SHAPES * len(ROLES)  # buffers kept beyond those a CUDA graph captured


class DiskStaging:
    """A disk table's page-locked buffers, by ``(stream, role, shape, dtype)``: the latest
    ``KEPT`` and every one a CUDA graph capture used (its addresses are the graph's), and the
    first error a host function met."""

    def __init__(self) -> None:
        self.buffers: OrderedDict[tuple, tuple] = OrderedDict()  # least recently used first
        self.kept: dict[tuple, tuple] = {}  # used inside a capture: kept until close
        self.retired: list = []  # buffers dropped once their stream passed them (a host call)
        self.error: BaseException | None = None
        self.lock = threading.Lock()
        self.captured: list[int] = []  # host calls captured in graphs: kept until close

    def get(self, stream, role: str, shape: tuple, dtype, capturing: bool) -> np.ndarray:
        """The page-locked buffer of that key (made when missing; never inside a capture, and
        one used inside a capture is kept until close)."""
        key = (stream.ptr, role, tuple(shape), np.dtype(dtype).str)
        with self.lock:
            self.retired.clear()  # here, not on CUDA's thread: freeing may call CUDA
            if key in self.kept:
                return self.kept[key][1]
            if key not in self.buffers:
                if capturing:
                    raise RuntimeError(
                        f"a disk table's GPU lookup of ids of shape {tuple(shape)} is being "
                        "captured in a CUDA graph before any lookup of that shape on this "
                        "stream: look one batch of each captured shape up outside the capture "
                        "first (its staging buffers are made then, at the addresses the graph "
                        "replays)")
                count = math.prod(shape)
                nbytes = max(count, 1) * np.dtype(dtype).itemsize
                memory = cupy_module().cuda.alloc_pinned_memory(nbytes)
                self.buffers[key] = (memory, np.frombuffer(memory, dtype, count).reshape(shape),
                                     stream)
                self.retire_oldest()
            self.buffers.move_to_end(key)
            if capturing:
                self.kept[key] = self.buffers.pop(key)
                return self.kept[key][1]
            return self.buffers[key][1]

    def retire_oldest(self) -> None:
        """Drop the least recently used buffers past ``KEPT``, each once its stream has passed
        the work queued on it (a host call there lets it go); one whose stream is capturing a
        graph now is kept instead."""
        while len(self.buffers) > KEPT:
            key, entry = self.buffers.popitem(last=False)
            memory, _, stream = entry
            if stream.is_capturing():
                self.kept[key] = entry
            else:
                host_functions.enqueue(stream, lambda memory=memory: self.retired.append(memory),
                                       kept=False)

    def raise_error(self) -> None:
        """Raise (once) the error a host function met."""
        with self.lock:
            error, self.error = self.error, None
        if error is not None:
            raise error

    def close(self) -> None:
        """Release the buffers and the captured host calls (the caller waited for the streams
        that used them)."""
        self.buffers.clear()
        self.kept.clear()
        self.retired.clear()
        host_functions.forget(self.captured)
        self.captured.clear()


def gather_staged(storage, job: Gather) -> None:
    """Enqueue a GPU gather of ``storage`` (a ``DiskStorage``) on ``job.stream``: ids to
    page-locked memory, rows read and gathered there by a host function, rows to ``job.out``
    (with ``job.expected``: ``job.out`` comes over first, and only the changed heads are
    gathered)."""
    if storage.staging is None:
        storage.staging = DiskStaging()
    staging = storage.staging
    stream = job.stream
    capturing = bool(stream.is_capturing())
    ids = staging.get(stream, "ids", job.ids.shape, job.ids.dtype, capturing)
    rows = staging.get(stream, "rows", job.out.shape, job.out.dtype, capturing)
    job.ids.get(stream=stream, out=ids, blocking=False)
    expected = None
    if job.expected is not None:
        expected = staging.get(stream, "expected", job.expected.shape, job.expected.dtype,
                               capturing)
        job.expected.get(stream=stream, out=expected, blocking=False)
        job.out.get(stream=stream, out=rows, blocking=False)
    host = dataclasses.replace(job, side=HOST, ids=ids, out=rows, expected=expected,
                               worker=True, stream=None)

    def read(_arg=None) -> None:
        try:
            storage.gather(host)
        except BaseException as error:  # noqa: BLE001 (raised by the next lookup)
            rows.view(np.uint8)[...] = 0xFF  # NaN bits: never rows that look right
            with staging.lock:
                staging.error = staging.error or error

    key = host_functions.enqueue(stream, read, kept=capturing)  # a replay runs it again
    if capturing:
        staging.captured.append(key)
    job.out.set(rows, stream=stream)
