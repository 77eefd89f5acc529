"""Rows in page-locked host memory mapped into the GPU: read by the CPU and, over PCIe, the GPU
(registered, or in large GPU pages: ``memory.large_pages``)."""

from __future__ import annotations

import numpy as np

from ...codecs.records import record_bytes, record_views
from ...formats import Format
from ...memory.large_pages import host_buffer
from ...runtime.backends import HOST
from .base import Gather, Storage
from .cpu import gather_host, write_host
from .gpu import gather_device


class PinnedStorage(Storage):
    """``[num_rows, head_dim]`` values of ``fmt`` in pinned host memory of their size; a
    block-scaled format's rows packed with their block scales, one record per row (``packed``),
    which the CPU and the GPU both read as records. ``gpu_pages``: how the GPU maps the memory,
    ``"registered"`` or ``"large"`` (``memory.large_pages``; default: the process's choice)."""

    placement = "pinned"
    page_locked = True

    def __init__(self, num_rows: int, head_dim: int, fmt: Format, gpu_pages: str | None = None):
        super().__init__(num_rows, head_dim, fmt)
        shape = (num_rows, record_bytes(fmt, head_dim))
        self.buffer = host_buffer(shape[0] * shape[1], gpu_pages)
        host = self.buffer.array.reshape(shape)
        device = self.buffer.device_array(shape, np.uint8)
        self.packed = fmt.blocked
        if fmt.blocked:
            self.records = host
            self.host_view, self.host_scales = record_views(host, fmt, head_dim)
            self.device_view, self.device_scales = record_views(device, fmt, head_dim, raw=True)
            host[:, fmt.row_bytes(head_dim):] = 0  # the padding
        else:
            self.host_view = host.view(fmt.dtype)
            self.device_view = device.view(fmt.raw)

    def write_rows(self, local_start: int, rows, scales=None) -> None:
        """Host stores (a device block comes over first): visible to the GPU when this returns."""
        write_host(self.host_view.view(self.format.raw), local_start, rows)
        if scales is not None:
            write_host(self.host_scales, local_start, scales)

    def gather(self, job: Gather) -> None:
        """The CPU gather for host ids; the GPU gather through the mapped address otherwise."""
        if job.side is HOST:
            gather_host(self.host_view.view(self.format.raw), self.format.code, job,
                        self.host_scales, self.records)
        else:
            self.used_on(job.stream)
            gather_device(self.device_view, self.format.code, job, self.device_scales)

    def used_on(self, stream) -> None:
        """The buffer is written and released only after the work of every stream that read
        it."""
        super().used_on(stream)
        self.buffer.used_on(stream)

    def close(self) -> None:
        """Unregister the memory (after the streams that read it are done); the host view stays
        readable as ordinary memory, the GPU can no longer read it."""
        self.buffer.close()
        self.device_view = self.device_scales = None
