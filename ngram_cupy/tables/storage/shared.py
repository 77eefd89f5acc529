"""Rows in a node-wide shared-memory segment (``shared_memory``): one copy for every process.

The first process to ask for the rows fills the segment; the others map it. On a GPU each
process page-locks its mapping (``cudaHostRegister``, as ``"pinned"`` does with private
memory), so the GPU reads the rows over UVA and every GPU lookup, prefetch and hot tier works as
over a pinned table; without a GPU the CPU gathers read the mapping. ``write_rows`` refuses:
other processes read the rows too. The mapping itself (``segment.memory``) is shared and
writable in every process, for callers that coordinate writes themselves. Where shared memory
cannot hold the rows they are in private memory (``segment.shared`` False, with a warning).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import mmap
import warnings
from collections.abc import Callable

import numpy as np

from ...formats import Format
from ...memory import shared as shared_memory
from ...memory.large_pages import gpu_pages_wanted
from ...memory.pinned import PinnedBuffer
from ...runtime.backends import HOST, gpu_available
from .base import Gather, Storage, placement_list
from .cpu import gather_host
from .gpu import gather_device

# Bytes after the rows in a segment; the first is 1 once a row optimizer wrote the rows.
FLAG_BYTES = 64


def block_scales_refusal(fmt: Format) -> str:
    """Why a segment cannot hold a block-scaled format's rows."""
    return (f"placement='shared' holds tables of one array; {fmt.name} rows carry block scales "
            f"beside them: use placement {placement_list('pinned', 'cpu')}")


def content_key(rows: np.ndarray, fmt: Format) -> str:
    """The segment key of rows given in memory: their format, shape and a hash of their bytes."""
    digest = hashlib.blake2b(np.ascontiguousarray(rows).view(np.uint8).reshape(-1).data,
                             digest_size=32).hexdigest()
    return json.dumps({"content": digest, "format": fmt.name, "shape": list(rows.shape)})


class SharedStorage(Storage):
    """``[num_rows, head_dim]`` values of ``fmt`` in the shared segment of ``key``.

    ``fill(rows)`` writes the raw rows (a writable NumPy ``[num_rows, head_dim]`` array of
    ``fmt.raw``) when this process creates the segment; it is not called when it attaches.
    ``timeout`` and ``strict``: as ``shared_memory.attach``.
    """

    placement = "shared"
    writable = False
    serves_after_close = False  # detached / unmapped: a closed table refuses lookups

    def __init__(self, key: str, num_rows: int, head_dim: int, fmt: Format,
                 fill: Callable[[np.ndarray], None], *, huge_pages: bool | None = None,
                 timeout: float | None = None, strict: bool | None = None):
        if fmt.blocked:
            raise ValueError(block_scales_refusal(fmt))
        super().__init__(num_rows, head_dim, fmt)
        shape = (num_rows, head_dim)

        def fill_memory(memory: mmap.mmap) -> None:
            fill(np.frombuffer(memory, fmt.raw, count=num_rows * head_dim).reshape(shape))

        for generation in itertools.count():  # the first whose rows were never written
            named = json.dumps({"rows": key, "shape": list(shape), "format": fmt.name,
                                "generation": generation})
            self.segment = shared_memory.attach(named, self.nbytes + FLAG_BYTES, fill_memory,
                                                huge_pages=huge_pages, timeout=timeout,
                                                strict=strict)
            if not self.segment.memory[self.nbytes]:
                break
            self.segment.close()
        try:
            self.buffer = (PinnedBuffer(self.nbytes, memory=self.segment.memory)
                           if gpu_available() else None)
            if self.buffer is not None and gpu_pages_wanted() == "large":
                warnings.warn("a shared table's rows are a segment every process maps, which "
                              "the GPU maps registered, not in large GPU pages",
                              RuntimeWarning, stacklevel=2)
        except BaseException:
            self.segment.close()
            raise
        view = np.frombuffer(self.segment.memory, fmt.dtype, count=num_rows * head_dim)
        view.flags.writeable = False
        self.host_view = view.reshape(shape)
        if self.buffer is not None:
            self.device_view = self.buffer.device_array(shape, fmt.raw)

    @property
    def page_locked(self) -> bool:
        """Whether this process's mapping is registered for the GPU (until ``close``)."""
        return self.device_view is not None

    @property
    def shared_segment(self) -> shared_memory.Segment | None:
        """The segment, when it is shared memory (not the private fallback)."""
        return self.segment if self.segment.shared else None

    def training_refusal(self) -> str | None:
        """Every process may update the rows in place (Hogwild), while the segment is attached."""
        if self.segment.attached:
            return None
        return "the table is closed: its shared segment is detached"

    def will_write(self) -> None:
        """Flag the rows as written: the segment no longer answers to their name."""
        self.segment.memory[self.nbytes] = 1

    def training_rows(self) -> np.ndarray:
        """The raw rows in the segment's mapping, writable in every process."""
        count = self.num_rows * self.head_dim
        return np.frombuffer(self.segment.memory, self.format.raw, count=count).reshape(
            self.num_rows, self.head_dim)

    def write_rows(self, local_start: int, rows, scales=None) -> None:
        """Refused: other processes read these rows."""
        raise ValueError("a shared table's rows are read by every process on the node: they "
                         "are read-only")

    def gather(self, job: Gather) -> None:
        """The CPU gather for host ids; the GPU gather through the mapped address otherwise."""
        if job.side is HOST:
            gather_host(self.host_view.view(self.format.raw), self.format.code, job)
        else:
            self.used_on(job.stream)
            gather_device(self.device_view, self.format.code, job)

    def used_on(self, stream) -> None:
        """The registration is released only after the work of every stream that read it."""
        if self.buffer is not None:
            self.buffer.used_on(stream)

    def close(self) -> None:
        """Unregister (after the streams that read it) and detach: the kernel frees the segment
        once no process holds or maps it. The host view stays readable while it lives."""
        if self.buffer is not None:
            self.buffer.close()
            self.device_view = None
        self.segment.close()
