"""Rows in ordinary host memory (a NumPy array), gathered on the CPU by Numba."""

from __future__ import annotations

import numpy as np

from .. import gather_numba
from ..formats import Format
from .base import Gather, Storage


def gather_host(rows: np.ndarray, code: int, job: Gather) -> None:
    """The CPU gather of raw host ``rows`` of format ``code`` (the worker gathers serially: two
    threads running Numba parallel kernels at once abort the process under the workqueue
    threading layer)."""
    gather_numba.gather_rows(rows, code, job.row_start, job.scale, job.ids, job.out,
                             job.out_code, job.expected, parallel=False if job.worker else None)


class CpuStorage(Storage):
    """``[num_rows, head_dim]`` values of ``fmt`` in a NumPy array (the caller's, or new)."""

    placement = "cpu"

    def __init__(self, rows: np.ndarray, fmt: Format):
        super().__init__(rows.shape[0], rows.shape[1], fmt)
        self.host_view = rows

    @property
    def writable(self) -> bool:
        """A read-only caller array stays read-only."""
        return bool(self.host_view.flags.writeable)

    def write_rows(self, local_start: int, rows) -> None:
        """Copy the block in (a device block comes over first); done when this returns."""
        block = rows if isinstance(rows, np.ndarray) else rows.get()
        self.host_view.view(self.format.raw)[local_start : local_start + block.shape[0]] = block

    def gather(self, job: Gather) -> None:
        """The Numba gather."""
        gather_host(self.host_view.view(self.format.raw), self.format.code, job)
