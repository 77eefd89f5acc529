"""Hot rows in GPU memory over a cold storage: one gather reads each row from the tier it is in.

The hot rows (sorted local rows, see ``hot_rows``) are copied from the cold storage into a hot
tier in order, so a row's slot is its rank; the slot map says which rows are hot. A GPU lookup is
one launch of ``gather_tiered_rows`` (hot rows from GPU memory, the rest from the cold storage's
mapped pinned memory) that adds the rows read per tier to device counters, read only when
``counters`` is asked for: after the streams that ran lookups on the table, and those alone. A
CPU lookup (no GPU: both tiers in ordinary memory) runs the tiered Numba gather, counting the
same way. The fused ids + gather kernel reads the same tiers
(``device_tier`` over the cold rows) and adds to the same counters. Writes go to the cold rows
and to any hot copy of them; rows written any other way (through ``host_view``) leave the hot
copies stale until ``refresh`` copies them again.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from ...codecs.records import record_views
from ...runtime.backends import DEVICE, HOST, Backend, cuda_stream, cupy_module
from ...runtime.used_streams import UsedStreams
from .. import gather_numba
from ..hot_rows import build_map
from .base import Gather, Storage, placement_list
from .gpu import fill


def read_counts(counts) -> np.ndarray:
    """The ``(hot, cold)`` sums of finished device counters, copied on a stream of their own (the
    legacy default stream would wait for every other stream of the device)."""
    cupy = cupy_module()
    with counts.device:
        return counts.get(stream=cupy.cuda.Stream(non_blocking=True)).sum(axis=0)


def upload(stream, *arrays) -> list:
    """Device copies of host arrays, made on ``stream`` and finished when this returns: the
    first lookup may read them on any other stream (or a graph replay), with nothing ordering it
    after the copies otherwise."""
    cupy = cupy_module()
    with stream:
        copies = [cupy.asarray(array) for array in arrays]
    stream.synchronize()
    return copies


class DeviceTier(NamedTuple):
    """The GPU side of a hot tier, for kernels that read it: the slot map ``(words, ranks)``, the
    raw hot rows ``[hot, head_dim]``, the counters (uint64 ``[COUNTER_LANES, 2]``: hot, cold)
    and the hot rows' block scales (block-scaled formats; else None). Over packed cold rows the
    hot rows and scales are views into hot records laid out as the cold ones."""

    map: tuple[Any, Any]
    rows: Any
    counts: Any
    scales: Any = None


class TieredStorage(Storage):
    """``hot_rows`` (sorted unique local rows) of ``cold`` copied into a hot tier.

    The cold storage must hold its rows in host memory (``cpu`` or ``pinned``); when the GPU
    reads it (pinned memory), the hot tier and its map are in GPU memory too.
    """

    placement = "tiered"
    cold = None  # the storage under the tier, set by ``__init__`` (the base's ``cold`` is self)

    def __init__(self, cold: Storage, hot_rows: np.ndarray):
        super().__init__(cold.num_rows, cold.head_dim, cold.format)
        if cold.host_view is None:
            raise ValueError(f"hot_rows need a table in host memory (placement "
                             f"{placement_list('pinned', 'cpu')}), not {cold.placement!r}")
        self.cold = cold
        self.hot_rows = hot_rows
        self.host_view = cold.host_view
        self.map = build_map(hot_rows, 0, cold.num_rows)
        self.records = cold.records  # packed cold rows: packed hot ones
        self.packed = cold.packed
        self.host_scales = cold.host_scales
        if self.records is not None:
            self.host_hot_records = self.records[hot_rows]
            hot_view, self.host_hot_scales = record_views(self.host_hot_records, cold.format,
                                                          cold.head_dim)
            self.host_hot = hot_view.view(cold.format.raw)
        else:
            self.host_hot_records = None
            self.host_hot = self.host_view.view(cold.format.raw)[hot_rows]
            self.host_hot_scales = (None if cold.host_scales is None
                                    else cold.host_scales[hot_rows])
        self.host_counts = np.zeros(2, np.int64)
        self.device_map = self.device_hot = self.device_counts = self.device_hot_scales = None
        self.streams = UsedStreams()  # those whose kernels add to device_counts
        if cold.device_view is not None:
            from .. import gather_cupy

            packed = self.host_hot_records is not None
            with cold.device_view.device:
                words, ranks, hot, self.device_counts = upload(
                    cuda_stream(), *self.map, self.host_hot_records if packed else self.host_hot,
                    np.zeros((gather_cupy.COUNTER_LANES, 2), np.uint64))
                self.device_map = (words, ranks)
                if packed:  # the tier's records on the GPU, read as the cold ones are
                    self.device_hot, self.device_hot_scales = record_views(
                        hot, cold.format, cold.head_dim, raw=True)
                else:
                    self.device_hot = hot
                    if self.host_hot_scales is not None:
                        (self.device_hot_scales,) = upload(cuda_stream(), self.host_hot_scales)

    @property
    def device_tier(self) -> DeviceTier | None:
        """The tier on the GPU (over ``cold.device_view``), or None when the GPU cannot read it."""
        if self.device_hot is None:
            return None
        return DeviceTier(self.device_map, self.device_hot, self.device_counts,
                          self.device_hot_scales)

    @property
    def hot_nbytes(self) -> int:
        """Bytes of the hot tier and its slot map (GPU memory when the GPU reads the table)."""
        if self.host_hot_records is not None:
            return self.host_hot_records.nbytes + self.map.nbytes
        scales = 0 if self.host_hot_scales is None else self.host_hot_scales.nbytes
        return self.host_hot.nbytes + scales + self.map.nbytes

    @property
    def writable(self) -> bool:
        """As the cold storage."""
        return self.cold.writable

    @property
    def page_locked(self) -> bool:
        """As the cold storage."""
        return self.cold.page_locked

    def reads(self, side: Backend) -> bool:
        """As the cold storage (``device_view`` stays None: a kernel outside the storage reads
        ``cold.device_view`` through ``device_tier``, never the cold rows alone)."""
        return self.cold.reads(side)

    def write_rows(self, local_start: int, rows, scales=None) -> None:
        """Write the cold rows, then the hot copies of those among them."""
        self.cold.write_rows(local_start, rows, scales)
        stop = local_start + rows.shape[0]
        first, last = np.searchsorted(self.hot_rows, [local_start, stop])
        if first == last:
            return
        index = self.hot_rows[first:last] - local_start
        copies = [(rows, self.host_hot, self.device_hot)]
        if scales is not None:
            copies.append((scales, self.host_hot_scales, self.device_hot_scales))
        for source, host, device in copies:
            on_host = isinstance(source, np.ndarray)
            block = source[index] if on_host else source[DEVICE.asarray(index)]
            host[first:last] = block if on_host else block.get()
            if device is not None:
                with device.device:
                    fill(device[first:last], block, cuda_stream())

    def refresh(self) -> None:
        """Copy every hot row again from the cold rows: after they changed other than through
        ``write_rows`` (in place through ``host_view``, or a torch ``state_dict`` sharing it).
        Finished when this returns, as ``write_rows`` is."""
        self.host_hot[...] = self.host_view.view(self.cold.format.raw)[self.hot_rows]
        if self.host_hot_scales is not None:
            self.host_hot_scales[...] = self.host_scales[self.hot_rows]
        for host, device in ((self.host_hot, self.device_hot),
                             (self.host_hot_scales, self.device_hot_scales)):
            if device is not None:
                with device.device:
                    fill(device, host, cuda_stream())

    def refresh_hot_rows(self) -> None:
        """``refresh``, after the GPU lookups still reading the tier (refused while one of their
        streams captures a CUDA graph)."""
        self.wait_for_readers("refresh the hot rows")
        self.refresh()

    def rows_changed(self, local_rows: np.ndarray) -> None:
        """Copy the hot ones among these updated local rows into the tier (its hot copies stay
        coherent)."""
        if not local_rows.size:
            return
        slots = np.searchsorted(self.hot_rows, local_rows)
        slots = np.minimum(slots, self.hot_rows.shape[0] - 1)
        hit = self.hot_rows[slots] == local_rows if self.hot_rows.size else slots < 0
        if hit.any():
            raw = self.host_view.view(self.cold.format.raw)
            self.host_hot[slots[hit]] = raw[local_rows[hit]]
            if self.device_hot is not None:
                self.refresh()

    def gather(self, job: Gather) -> None:
        """The tiered gather of the ids' side (``job.dedup`` is not used: one launch)."""
        raw = self.cold.format.raw
        if job.side is HOST:
            packed = self.records is not None
            gather_numba.gather_rows(self.host_view.view(raw), self.format.code, job.row_start,
                                     job.scale, job.ids, job.out, job.out_code, job.expected,
                                     parallel=False if job.worker else None,
                                     hot=(self.map, self.host_hot_records if packed
                                          else self.host_hot),
                                     counts=self.host_counts, scales=self.host_scales,
                                     hot_scales=self.host_hot_scales,
                                     total_rows=job.total_rows, records=self.records)
            return
        from .. import gather_cupy

        assert job.side is DEVICE
        self.used_on(job.stream)
        gather_cupy.gather_rows(self.cold.device_view, self.format.code, job.row_start,
                                job.scale, job.ids, job.out, job.out_code, job.expected,
                                stream=job.stream, hot=(self.device_map, self.device_hot),
                                counts=self.device_counts, scales=self.cold.device_scales,
                                hot_scales=self.device_hot_scales, total_rows=job.total_rows,
                                bad_ids=job.bad_ids)

    @property
    def counters(self) -> dict[str, int]:
        """Rows read from each tier since creation. The GPU's counts are read after the streams
        that ran lookups on the table finish their work (those streams only, never the whole
        device); a RuntimeError while one of them is capturing a CUDA graph."""
        hot, cold = (int(count) for count in self.host_counts)
        if self.device_counts is not None:
            if self.streams.capturing():
                raise RuntimeError("cannot read the hot-row counters while a stream that looks "
                                   "up the table is capturing a CUDA graph: read them after the "
                                   "capture")
            self.streams.synchronize()
            device = read_counts(self.device_counts)
            hot, cold = hot + int(device[0]), cold + int(device[1])
        return {"hot_rows": hot, "cold_rows": cold}

    def used_on(self, stream) -> None:
        """Kernels on ``stream`` add to the counters and read the cold storage's memory, which
        must outlive them (and both tiers' rows, which writes wait for them to read)."""
        super().used_on(stream)
        self.streams.add(stream)
        self.cold.used_on(stream)

    def close(self) -> None:
        """Release the cold storage; the GPU tier goes with the last reference."""
        self.cold.close()
