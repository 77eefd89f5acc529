"""CPU kernels of the backward: ids grouped by row (a stable sort), then each row's gradients
summed in float64 in the ids' order and rounded once, in parallel over rows."""

from __future__ import annotations

import numpy as np
from numba import njit, prange

# Rows per parallel work item (one float64 accumulator each).
BLOCK = 256
# A counting sort over the table's rows beats a comparison sort up to this many rows per id.
COUNTING_ROWS_PER_ID = 8


@njit(cache=True, nogil=True)
def counting_order(ids: np.ndarray, low: int, rows: int):
    """``(order, unique, starts)`` of ids inside ``[low, low + rows)`` by a stable counting sort:
    ``ids[order]`` sorted, ``unique`` the distinct ids, ``starts`` [U + 1] their runs."""
    counts = np.zeros(rows + 1, np.int64)
    for i in range(ids.shape[0]):
        counts[ids[i] - low + 1] += 1
    distinct = 0
    for r in range(rows):
        if counts[r + 1]:
            distinct += 1
        counts[r + 1] += counts[r]
    unique = np.empty(distinct, np.int64)
    starts = np.empty(distinct + 1, np.int64)
    u = 0
    for r in range(rows):
        if counts[r + 1] > counts[r]:
            unique[u] = r + low
            starts[u] = counts[r]
            u += 1
    starts[distinct] = ids.shape[0]
    order = np.empty(ids.shape[0], np.int64)
    for i in range(ids.shape[0]):
        slot = ids[i] - low
        order[counts[slot]] = i
        counts[slot] += 1
    return order, unique, starts


def sorted_order(ids: np.ndarray, low: int, rows: int):
    """``(order, unique, starts)``: a stable grouping of ``ids`` by row (all inside ``[low, low +
    rows)``); counting sort when the rows are few against the ids, else NumPy's stable sort."""
    if not ids.shape[0]:  # an empty batch: no row, no term
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(1, np.int64)
    if rows <= COUNTING_ROWS_PER_ID * ids.shape[0]:
        return counting_order(ids, low, rows)
    order = np.argsort(ids, kind="stable")
    ordered = ids[order]
    firsts = np.flatnonzero(np.diff(ordered)) + 1
    starts = np.concatenate(([0], firsts, [ids.shape[0]])).astype(np.int64)
    return order, ordered[starts[:-1]].astype(np.int64), starts


@njit(cache=True, nogil=True, parallel=True)
def segment_sums(grad: np.ndarray, order: np.ndarray, starts: np.ndarray, out: np.ndarray):
    """``out[u] = float32(sum in float64 of grad[order[starts[u]:starts[u + 1]]])``."""
    count, width = out.shape
    for block in prange((count + BLOCK - 1) // BLOCK):
        acc = np.empty(width, np.float64)
        for u in range(block * BLOCK, min(count, (block + 1) * BLOCK)):
            acc[:] = 0.0
            for k in range(starts[u], starts[u + 1]):
                row = order[k]
                for d in range(width):
                    acc[d] += grad[row, d]
            for d in range(width):
                out[u, d] = np.float32(acc[d])
