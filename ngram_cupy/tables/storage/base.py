"""The storage interface every placement implements: one gather job, and the common base."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ...codecs.records import record_bytes
from ...formats import Format
from ...runtime.backends import HOST, Backend
from ...runtime.used_streams import UsedStreams
from ..row_ids import row_id_error


def placement_list(*names: str) -> str:
    """Placement names for a message, quoted and joined: ``'cpu', 'pinned' or 'gpu'``."""
    quoted = [repr(name) for name in names]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


def closed_table_error(placement: str) -> ValueError:
    """The error of a lookup of a closed table whose storage serves none after ``close()``."""
    return ValueError(f"the table is closed: a {placement!r} table serves no lookups after "
                      "close()")


def owned_positions(job: Gather, num_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """For a CPU gather whose storage reads row by row (mapped, disk): ``(positions, local
    ids)`` of the flat ids it must gather (all, or with ``job.expected`` those that differ),
    held by the storage; the other positions of those are zeroed in ``job.out`` (ids of other
    shards), and an id outside ``[0, job.total_rows)`` is an IndexError (``row_ids``)."""
    flat = job.ids.reshape(-1)
    if flat.size == 0:  # no ids (a row width of -1 cannot be inferred from no rows)
        return np.empty(0, np.int64), np.empty(0, flat.dtype)
    rows = job.out.reshape(flat.size, -1)
    where = (np.arange(flat.size) if job.expected is None
             else np.flatnonzero(job.expected.reshape(-1) != flat))
    rows[where] = 0
    local = flat[where] - job.row_start
    owned = (local >= 0) & (local < num_rows)
    if job.total_rows is not None:  # among the ids not owned (a pass this path makes anyway)
        other = where[~owned]
        outside = (flat[other] < 0) | (flat[other] >= job.total_rows)
        if outside.any():
            raise row_id_error(job.ids, int(other[outside.argmax()]), job.total_rows,
                               held=(job.row_start, job.row_start + num_rows))
    return where[owned], local[owned]


@dataclass
class Gather:
    """One gather: ids ``[T, H]`` (contiguous int32/int64 on ``side``) into the raw output
    ``out[T, H * head_dim]`` of format ``out_code``; rows dequantised with ``scale``.

    ``expected`` (int64 ``[T, H]``): ids whose rows ``out`` already holds (a finished prefetch),
    skipped. ``worker``: on the CPU prefetch worker (serial gathers only). ``dedup``: fetch each
    distinct id once (GPU; waits for the GPU). ``stream``: the CuPy stream (GPU).
    ``total_rows``: the whole table's rows; an id outside ``[0, total_rows)`` is an IndexError
    (``row_ids``; on the GPU raised later, ``bad_ids``), None leaves ids unchecked.
    """

    side: Backend
    ids: Any
    out: Any
    out_code: int
    row_start: int
    scale: np.float32
    expected: Any = None
    worker: bool = False
    dedup: bool = False
    stream: Any = None
    total_rows: int | None = None
    bad_ids: Any = None  # the table's BadIds: the GPU kernels note bad ids there (bad_ids)


class Storage:
    """The common part of every storage: geometry, and the defaults of optional methods."""

    placement = "?"
    writable = True
    host_view: np.ndarray | None = None
    device_view: Any = None
    host_scales: np.ndarray | None = None  # block scales beside ``host_view`` (blocked formats)
    records: np.ndarray | None = None  # host records ``host_view`` and ``host_scales`` view
    packed = False  # block-scaled rows packed with their scales, one record per row (``packed``)
    device_scales: Any = None  # block scales beside ``device_view``
    device_tier: Any = None  # a hot tier's GPU side over ``cold.device_view`` (``tiered``)
    page_locked = False  # rows in page-locked host memory the GPU reads over UVA
    device_resident = False  # rows in GPU memory: lookups there need no prefetch
    shared_segment: Any = None  # the node-wide segment holding the rows (``shared_memory``)
    serves_after_close = True  # lookups still read the rows after ``close`` (process memory)

    def __init__(self, num_rows: int, head_dim: int, fmt: Format):
        self.num_rows, self.head_dim, self.format = num_rows, head_dim, fmt
        self.readers = UsedStreams()  # the streams of GPU lookups that may still read the rows

    @property
    def nbytes(self) -> int:
        """Bytes of the rows, block scales included: whole records when packed."""
        if self.packed:
            return self.num_rows * record_bytes(self.format, self.head_dim)
        return self.num_rows * self.format.row_bytes(self.head_dim)

    def reads(self, side: Backend) -> bool:
        """Whether ids on ``side`` can gather from this storage."""
        return (self.host_view if side is HOST else self.device_view) is not None

    def write_rows(self, local_start: int, rows, scales=None) -> None:
        """Copy a raw block (and its block scales) into local rows ``[local_start, +len(rows))``."""
        raise NotImplementedError

    def gather(self, job: Gather) -> None:
        """Write the rows of ``job.ids`` into ``job.out``."""
        raise NotImplementedError

    def refusal(self, side: Backend) -> str | None:
        """Why ids on ``side`` cannot read this storage, when it has more to say than its
        placement; None by default."""
        return None

    def will_read(self, ids, row_start: int, stream=None) -> None:
        """A prefetch of ``ids`` (global, on the side of the lookup) is starting: nothing to
        prepare by default (mapped files advise their pages)."""

    def used_on(self, stream) -> None:
        """A GPU kernel on ``stream`` reads the rows: writes and closing wait for it."""
        self.readers.add(stream)

    def wait_for_readers(self, doing: str) -> None:
        """Wait for the GPU lookups still running on the streams that read the rows (those
        streams only); a RuntimeError while one of them is capturing a CUDA graph (a wait there
        would break the capture)."""
        if self.readers.capturing():
            raise RuntimeError(f"cannot {doing} while a stream that looks up the table is "
                               f"capturing a CUDA graph: {doing} after the capture")
        self.readers.synchronize()

    @property
    def cold(self) -> Storage:
        """The storage holding the rows themselves: this one (a tiered storage's is the one
        under its hot tier)."""
        return self

    @property
    def counters(self) -> dict[str, int]:
        """Rows read from each tier: none without a hot tier."""
        return {}

    def cache_stats(self) -> dict:
        """A row cache's counters (a disk table's): none here."""
        return {}

    def refresh_hot_rows(self) -> None:
        """Copy the hot tier's rows again from the rows: nothing without a hot tier."""

    def rows_changed(self, local_rows: np.ndarray) -> None:
        """These local rows changed in place (an optimizer step): nothing holds copies of them
        by default."""

    def training_refusal(self) -> str | None:
        """Why a row optimizer cannot update these rows in place (``training_rows``), or None."""
        if not self.writable:
            return "the table's rows are read-only (a read-only array was adopted)"
        return None

    def training_rows(self) -> np.ndarray:
        """The raw rows ``[num_rows, head_dim]`` a row optimizer updates in place."""
        return self.host_view.view(self.format.raw)

    def will_write(self) -> None:
        """A row optimizer is about to write ``training_rows``: nothing to note by default."""

    def raise_pending(self) -> None:
        """Raise a failure of a GPU lookup that could not raise when it ran (a disk table's host
        reads): none by default."""

    def close(self) -> None:
        """Nothing to release by default."""
