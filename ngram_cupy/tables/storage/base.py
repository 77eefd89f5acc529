"""The storage interface every placement implements: one gather job, and the common base."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ...runtime.backends import HOST, Backend
from ..formats import Format


@dataclass
class Gather:
    """One gather: ids ``[T, H]`` (contiguous int32/int64 on ``side``) into the raw output
    ``out[T, H * head_dim]`` of format ``out_code``; rows dequantised with ``scale``.

    ``expected`` (int64 ``[T, H]``): ids whose rows ``out`` already holds (a finished prefetch),
    skipped. ``worker``: on the CPU prefetch worker (serial gathers only). ``dedup``: fetch each
    distinct id once (GPU; waits for the GPU). ``stream``: the CuPy stream (GPU).
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


class Storage:
    """The common part of every storage: geometry, and the defaults of optional methods."""

    placement = "?"
    writable = True
    host_view: np.ndarray | None = None
    device_view: Any = None
    host_scales: np.ndarray | None = None  # block scales beside ``host_view`` (blocked formats)
    device_scales: Any = None  # block scales beside ``device_view``

    def __init__(self, num_rows: int, head_dim: int, fmt: Format):
        self.num_rows, self.head_dim, self.format = num_rows, head_dim, fmt

    @property
    def nbytes(self) -> int:
        """Bytes of the rows, block scales included."""
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

    def used_on(self, stream) -> None:
        """Nothing to remember by default."""

    def close(self) -> None:
        """Nothing to release by default."""
