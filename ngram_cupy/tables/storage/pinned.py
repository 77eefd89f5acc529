"""Rows in page-locked host memory mapped into the GPU: read by the CPU and, over PCIe, the GPU."""

from __future__ import annotations

from ...runtime.backends import HOST
from ..formats import Format
from ..pinned import PinnedBuffer
from .base import Gather, Storage
from .cpu import gather_host
from .gpu import gather_device


class PinnedStorage(Storage):
    """``[num_rows, head_dim]`` values of ``fmt`` in a ``PinnedBuffer`` of exactly their size."""

    placement = "pinned"

    def __init__(self, num_rows: int, head_dim: int, fmt: Format):
        super().__init__(num_rows, head_dim, fmt)
        shape = (num_rows, head_dim)
        self.buffer = PinnedBuffer(self.nbytes)
        self.host_view = self.buffer.array.view(fmt.dtype).reshape(shape)
        self.device_view = self.buffer.device_array(shape, fmt.raw)

    def write_rows(self, local_start: int, rows) -> None:
        """Host stores (a device block comes over first): visible to the GPU when this returns."""
        block = rows.get() if hasattr(rows, "get") else rows
        self.host_view.view(self.format.raw)[local_start : local_start + block.shape[0]] = block

    def gather(self, job: Gather) -> None:
        """The CPU gather for host ids; the GPU gather through the mapped address otherwise."""
        if job.side is HOST:
            gather_host(self.host_view.view(self.format.raw), self.format.code, job)
        else:
            self.used_on(job.stream)
            gather_device(self.device_view, self.format.code, job)

    def used_on(self, stream) -> None:
        """The buffer is written and released only after the work of every stream that read
        it."""
        super().used_on(stream)
        self.buffer.used_on(stream)

    def close(self) -> None:
        """Unregister the memory (after the streams that read it are done); the host view stays
        readable as ordinary memory, the GPU can no longer read it."""
        self.buffer.close()
        self.device_view = None
