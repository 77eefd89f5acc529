"""Rows in page-locked host memory mapped into the GPU: read by the CPU and, over PCIe, the GPU."""

from __future__ import annotations

import numpy as np

from ...formats import Format
from ...runtime.backends import HOST
from ..pinned_memory import PinnedBuffer
from .base import Gather, Storage
from .cpu import gather_host, write_host
from .gpu import gather_device


class PinnedStorage(Storage):
    """``[num_rows, head_dim]`` values of ``fmt`` in a ``PinnedBuffer`` of exactly their size (a
    block-scaled format's block scales in a second one)."""

    placement = "pinned"
    page_locked = True

    def __init__(self, num_rows: int, head_dim: int, fmt: Format):
        super().__init__(num_rows, head_dim, fmt)
        shape = (num_rows, fmt.row_width(head_dim))
        self.buffer = PinnedBuffer(shape[0] * shape[1] * fmt.itemsize)
        self.host_view = self.buffer.array.view(fmt.dtype).reshape(shape)
        self.device_view = self.buffer.device_array(shape, fmt.raw)
        self.scale_buffer = None
        if fmt.blocked:
            scale_shape = (num_rows, fmt.scale_width(head_dim))
            self.scale_buffer = PinnedBuffer(scale_shape[0] * scale_shape[1])
            self.host_scales = self.scale_buffer.array.reshape(scale_shape)
            self.device_scales = self.scale_buffer.device_array(scale_shape, np.uint8)

    def write_rows(self, local_start: int, rows, scales=None) -> None:
        """Host stores (a device block comes over first): visible to the GPU when this returns."""
        write_host(self.host_view.view(self.format.raw), local_start, rows)
        if scales is not None:
            write_host(self.host_scales, local_start, scales)

    def gather(self, job: Gather) -> None:
        """The CPU gather for host ids; the GPU gather through the mapped address otherwise."""
        if job.side is HOST:
            gather_host(self.host_view.view(self.format.raw), self.format.code, job,
                        self.host_scales)
        else:
            self.used_on(job.stream)
            gather_device(self.device_view, self.format.code, job, self.device_scales)

    def used_on(self, stream) -> None:
        """The buffers are written and released only after the work of every stream that read
        them."""
        super().used_on(stream)
        self.buffer.used_on(stream)
        if self.scale_buffer is not None:
            self.scale_buffer.used_on(stream)

    def close(self) -> None:
        """Unregister the memory (after the streams that read it are done); the host view stays
        readable as ordinary memory, the GPU can no longer read it."""
        self.buffer.close()
        self.device_view = None
        if self.scale_buffer is not None:
            self.scale_buffer.close()
            self.device_scales = None
