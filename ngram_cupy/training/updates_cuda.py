"""GPU kernel of the row-wise updates: one thread per distinct row runs ``update_row``, the very
code the CPU kernel inlines (each float32 operation rounded on its own: no fused multiply-add),
on gradients summed by the backward's kernel (float64, the ids' order): the CPU's bits."""

from __future__ import annotations

import numpy as np
from numba import cuda

from ..runtime.cuda_launch import NumbaKernel
from .updates_numba import update_row

THREADS = 128


def _update_rows_kernel(kind, rows, code, local, values, first, second, hyper, stochastic,
                        seed, step, row_start):
    """Row ``local[u]`` updated from its summed gradient ``values[u]`` (overwritten: scratch)."""
    u = cuda.grid(1)
    if u < local.shape[0]:
        update_row(kind, rows, code, local[u], values[u], first, second, hyper, stochastic,
                   seed, step, row_start)


update_rows_kernel = NumbaKernel(_update_rows_kernel)


def launch_update_rows(kind: int, rows, code: int, local, values, first, second, hyper,
                       stochastic: bool, seed: int, step: int, row_start: int = 0,
                       stream=None) -> None:
    """Apply optimizer ``kind`` to the rows ``local`` (int64 ``[U]``, distinct) of raw ``rows``
    from their gradients ``values`` (float32 ``[U, D]``, used as scratch) on ``stream``; state
    in ``first`` / ``second``, hyper-parameters as ``updates_numba.update_rows`` reads them."""
    count = local.shape[0]
    if count:
        update_rows_kernel((count + THREADS - 1) // THREADS, THREADS,
                           (np.int64(kind), rows, np.int64(code), local, values, first, second,
                            hyper, np.bool_(stochastic), np.uint64(seed), np.uint64(step),
                            np.int64(row_start)),
                           stream)
