"""Rows in GPU memory (a CuPy array), gathered by ``kernels/gather.cu``."""

from __future__ import annotations

from typing import Any

import numpy as np

from ...formats import Format
from ...runtime.backends import DEVICE, cuda_stream
from .base import Gather, Storage


def gather_device(rows, code: int, job: Gather, scales=None) -> None:
    """The GPU gather of raw ``rows`` (device memory, or host memory mapped for the GPU) and
    their block ``scales`` on ``job.stream``; with ``job.dedup`` each distinct id is fetched
    once."""
    from .. import gather_cupy

    if job.dedup and job.expected is None:
        gather_cupy.gather_unique_rows(rows, code, job.row_start, job.scale, job.ids, job.out,
                                       job.out_code, stream=job.stream, scales=scales,
                                       total_rows=job.total_rows)
    else:
        gather_cupy.gather_rows(rows, code, job.row_start, job.scale, job.ids, job.out,
                                job.out_code, job.expected, stream=job.stream, scales=scales,
                                total_rows=job.total_rows, bad_ids=job.bad_ids)


def fill(destination, rows, stream: Any) -> None:
    """Copy a raw NumPy or CuPy block into device rows on ``stream``, then wait for the copy.

    Waiting ends the fill on the host: a gather on any other stream, or a CUDA graph replayed
    later, reads the new rows (an event would leave a captured lookup waiting on work outside
    its capture). Fills are loading, not the lookup path, so the wait costs nothing that
    matters.
    """
    with stream:
        if isinstance(rows, np.ndarray) and destination.flags.c_contiguous:
            destination.set(np.ascontiguousarray(rows))
        elif isinstance(rows, np.ndarray):  # views into packed records: upload, then copy in
            destination[...] = DEVICE.asarray(np.ascontiguousarray(rows))
        else:
            destination[...] = rows
    stream.synchronize()


class GpuStorage(Storage):
    """``[num_rows, head_dim]`` raw bits of ``fmt`` in a CuPy array (the caller's, or new); a
    block-scaled format's rows and block ``scales``, as views into one record per row when
    ``packed`` (see ``codecs.records``)."""

    placement = "gpu"
    device_resident = True

    def __init__(self, rows, fmt: Format, scales=None, packed: bool = False):
        super().__init__(rows.shape[0], rows.shape[1] * fmt.pack, fmt)
        self.device_view = rows
        self.device_scales = scales
        self.packed = packed

    def write_rows(self, local_start: int, rows, scales=None) -> None:
        """Copy the block over on CuPy's current stream, finished when this returns."""
        with self.device_view.device:
            fill(self.device_view[local_start : local_start + rows.shape[0]], rows,
                 cuda_stream())
            if scales is not None:
                fill(self.device_scales[local_start : local_start + scales.shape[0]], scales,
                     cuda_stream())

    def training_refusal(self) -> str | None:
        """The rows train in place on the GPU: under torch's optimizers (sparse gradients on the
        device rows) and the row optimizers (``training.updates_cuda``)."""
        return None

    def training_rows(self):
        """The raw rows (a CuPy array) ``[num_rows, head_dim]`` a row optimizer updates in
        place, on the GPU (``training.updates_cuda``)."""
        return self.device_view.view(self.format.raw)

    def gather(self, job: Gather) -> None:
        """The CUDA gather."""
        assert job.side is DEVICE
        self.used_on(job.stream)
        gather_device(self.device_view, self.format.code, job, self.device_scales)
