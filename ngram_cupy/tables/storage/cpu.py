"""Rows in ordinary host memory (a NumPy array), gathered on the CPU by Numba."""

from __future__ import annotations

import numpy as np

from ...formats import Format
from .. import gather_numba
from .base import Gather, Storage


def gather_host(rows: np.ndarray, code: int, job: Gather, scales=None, records=None) -> None:
    """The CPU gather of raw host ``rows`` of format ``code``, with their block ``scales`` (or
    the packed ``records`` they are views into; the worker gathers serially: two threads
    running Numba parallel kernels at once abort the process under the workqueue threading
    layer)."""
    gather_numba.gather_rows(rows, code, job.row_start, job.scale, job.ids, job.out,
                             job.out_code, job.expected, parallel=False if job.worker else None,
                             scales=scales, total_rows=job.total_rows, records=records)


class CpuStorage(Storage):
    """``[num_rows, head_dim]`` values of ``fmt`` in a NumPy array (the caller's, or new); a
    block-scaled format's packed rows with their block ``scales`` beside them, or both as views
    into one record per row (``records``, see ``packed``)."""

    placement = "cpu"

    def __init__(self, rows: np.ndarray, fmt: Format, scales: np.ndarray | None = None,
                 records: np.ndarray | None = None):
        super().__init__(rows.shape[0], rows.shape[1] * fmt.pack, fmt)
        self.host_view = rows
        self.host_scales = scales
        self.records = records
        self.packed = records is not None

    @property
    def writable(self) -> bool:
        """A read-only caller array stays read-only."""
        return bool(self.host_view.flags.writeable)

    def write_rows(self, local_start: int, rows, scales=None) -> None:
        """Copy the block in (a device block comes over first); done when this returns."""
        write_host(self.host_view.view(self.format.raw), local_start, rows)
        if scales is not None:
            write_host(self.host_scales, local_start, scales)

    def gather(self, job: Gather) -> None:
        """The Numba gather."""
        gather_host(self.host_view.view(self.format.raw), self.format.code, job, self.host_scales,
                    self.records)


def write_host(destination: np.ndarray, local_start: int, rows) -> None:
    """Copy a NumPy or CuPy block into host rows from ``local_start``."""
    block = rows if isinstance(rows, np.ndarray) else rows.get()
    destination[local_start : local_start + block.shape[0]] = block
