"""The ``ids`` command's pipeline: token batches in, Parquet with id columns out, overlapped.

pyarrow decodes and encodes Parquet with the GIL released and the id kernels release it too, so
a reader thread, the calling thread (ids) and a writer thread keep the cores busy at once.
Queues of ``DEPTH`` items bound the memory in flight; output batches are grouped into row groups
of about ``ROW_GROUP_BYTES`` (one row group per small input batch costs time and compression),
except the first ones: ``FIRST_ROW_GROUP_BYTES``, then each twice the last, so the writer, which
takes most of the time, starts after one call instead of a full row group. Each mapper call
computes about ``CALL_IDS_BYTES`` of ids (``tokens_per_call``): NumPy backs arrays from 4 MiB with
huge pages (a small buffer per call costs a page fault per 4 KiB), and the int64 ids narrowed to
int32 stay in the last-level cache. The id columns are written without dictionary or statistics:
hashed ids rarely repeat in a page, and their min/max say nothing.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import numba
import pyarrow as pa
import pyarrow.parquet as pq

DEPTH = 2
ROW_GROUP_BYTES = 32 << 20
FIRST_ROW_GROUP_BYTES = 4 << 20
CALL_IDS_BYTES = 8 << 20
POLL_SECONDS = 0.1

T = TypeVar("T")


def writer_options(schema: pa.Schema, input_schema: pa.Schema,
                   compression: str = "zstd") -> dict[str, Any]:
    """ParquetWriter keywords: dictionary encoding and statistics for the input's columns only."""
    return dict(compression=compression, use_dictionary=input_schema.names,
                write_statistics=input_schema.names)


def tokens_per_call(ids_per_token: int, itemsize: int) -> int:
    """Tokens whose ids fill about ``CALL_IDS_BYTES``: the size of one mapper call."""
    return max(1, CALL_IDS_BYTES // (ids_per_token * itemsize))


def open_output(path: str) -> pa.NativeFile:
    """``path`` opened for writing; an existing empty file (a reserved temporary) is written
    without truncating it: ext4 writes a truncated file's data to disk when it is closed (its
    ``auto_da_alloc`` guard), measured at 0.8 s per GB added to the command's time."""
    empty = os.path.isfile(path) and os.path.getsize(path) == 0
    return pa.OSFile(path, "a" if empty else "w")


@contextlib.contextmanager
def one_numba_thread() -> Iterator[None]:
    """The calling thread's Numba kernels run on one thread within the block (Numba keeps the
    count per thread): the writer bounds the pipeline's speed and serial ids stay ~10x ahead of
    it, where a pool thread would take the writer's core."""
    previous = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        yield
    finally:
        numba.set_num_threads(previous)


def read_ahead(items: Iterable[T], depth: int = DEPTH) -> Iterator[T]:
    """``items``, produced by a background thread at most ``depth`` ahead of the consumer.

    An error in the producer is raised here; closing the iterator stops the producer.
    """
    slots: queue.Queue = queue.Queue(depth)
    stop = threading.Event()

    def put(entry: tuple[str, Any]) -> bool:
        while not stop.is_set():
            try:
                slots.put(entry, timeout=POLL_SECONDS)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in items:
                if not put(("item", item)):
                    return
            put(("done", None))
        except BaseException as error:  # handed to the consumer, raised there
            put(("error", error))

    thread = threading.Thread(target=produce, name="ngram-cupy-reader", daemon=True)
    thread.start()
    try:
        while True:
            kind, value = slots.get()
            if kind == "done":
                return
            if kind == "error":
                raise value
            yield value
    finally:
        stop.set()
        thread.join()


class BackgroundWriter:
    """Writes tables with ``write`` in a thread, at most ``depth`` waiting; ``close`` joins it
    and raises the writer's error, if any."""

    def __init__(self, write: Callable[[pa.Table], None], depth: int = DEPTH) -> None:
        self._write = write
        self._tables: queue.Queue = queue.Queue(depth)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="ngram-cupy-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            table = self._tables.get()
            if table is None:
                return
            if self._error is None:
                try:
                    self._write(table)
                except BaseException as error:  # raised in the caller's thread
                    self._error = error

    def put(self, table: pa.Table) -> None:
        """Queue ``table`` (blocks while ``depth`` tables wait)."""
        if self._error is not None:
            raise self._error
        self._tables.put(table)

    def close(self) -> None:
        """Wait until every queued table is written (or dropped after an error)."""
        self._tables.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error


def write_ids(batches: Iterable[pa.RecordBatch], mapper: Callable[[pa.RecordBatch],
              pa.RecordBatch], path: str, schema: pa.Schema, options: dict[str, Any],
              on_batch: Callable[[pa.RecordBatch], None]) -> None:
    """Map every batch (read ahead in a thread) and write the results to ``path`` as Parquet
    (in another thread), calling ``on_batch`` with each mapped batch.

    ``mapper`` must return batches that stay valid (no reused buffers): up to a row group plus
    ``DEPTH`` tables are in flight.
    """
    with open_output(path) as sink, pq.ParquetWriter(sink, schema, **options) as writer:
        out = BackgroundWriter(lambda table: writer.write_table(table,
                                                                row_group_size=table.num_rows))
        try:
            group: list[pa.RecordBatch] = []
            size = 0
            target = min(FIRST_ROW_GROUP_BYTES, ROW_GROUP_BYTES)
            for batch in read_ahead(batches):
                with one_numba_thread():
                    mapped = mapper(batch)
                group.append(mapped)
                size += mapped.nbytes
                on_batch(mapped)
                if size >= target:
                    out.put(pa.Table.from_batches(group, schema))
                    group, size = [], 0
                    target = min(2 * target, ROW_GROUP_BYTES)
            if group:
                out.put(pa.Table.from_batches(group, schema))
        finally:
            out.close()
