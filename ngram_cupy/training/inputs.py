"""Checks of a backward's inputs: ids and output gradients brought to ``[N]`` and ``[N, D]``."""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..codecs.dequant import float32_values
from ..formats import find_format
from ..runtime.checks import INDEX_DTYPES
from ..tables.row_ids import row_id_error
from . import backward_numba


@njit(cache=True, nogil=True)
def first_outside(ids: np.ndarray, low: int, high: int) -> int:
    """The position of the first id outside ``[low, high)``, or -1."""
    for i in range(ids.shape[0]):
        if ids[i] < low or ids[i] >= high:
            return i
    return -1


def check_ids_inside(ids: np.ndarray, total_rows: int, name: str = "ids",
                     held: tuple[int, int] | None = None) -> None:
    """The lookup's IndexError (``row_ids.row_id_error``) for the first id outside ``held``, the
    global rows ``[start, stop)`` a table holds (an optimizer updates only those), else outside
    ``[0, total_rows)``."""
    low, high = (0, total_rows) if held is None else held
    flat = ids.reshape(-1)
    if ids.size == 0:
        return
    if isinstance(flat, np.ndarray):
        bad = first_outside(flat, low, high)
    else:  # CuPy: one reduction, then the first position on the host
        outside = (flat < low) | (flat >= high)
        bad = int(outside.argmax()) if bool(outside.any()) else -1
    if bad >= 0:
        raise row_id_error(ids, bad, total_rows, name, held, owned=True)


def check_owned_ids(ids, table, name: str = "ids") -> None:
    """``check_ids_inside`` against the rows ``table`` holds: the only ones a step updates."""
    check_ids_inside(ids, table.total_rows, name,
                     (table.row_start, table.row_start + table.num_rows))


def flat_inputs(ids, grad_out, grad_format=None):
    """``(ids [N], grad [N, D])`` views of ``ids`` ``[N]`` / ``[T, H]`` and ``grad_out``
    ``[N, D]``, ``[T, H, D]`` or ``[T, H * D]`` (float32, bfloat16, float16: ``grad_format``
    names torch bfloat16 passed as bits); ValueError / TypeError name the argument."""
    if ids.ndim not in (1, 2):
        raise ValueError(f"ids must be [N] or [T, H], got shape {tuple(ids.shape)}")
    if np.dtype(ids.dtype) not in INDEX_DTYPES:
        raise TypeError(f"ids must be int32 or int64, got {ids.dtype}")
    fmt = grad_format if grad_format is not None else find_format(grad_out.dtype)
    if fmt is None or not fmt.output or (grad_format is None
                                                      and grad_out.dtype.kind in "iu"):
        raise TypeError(f"grad_out must be float32, bfloat16 or float16, got {grad_out.dtype}")
    count = int(np.prod(ids.shape))
    shape = tuple(grad_out.shape)
    if ids.ndim == 1 and len(shape) == 2 and shape[0] == count:
        head_dim = shape[1]
    elif ids.ndim == 2 and len(shape) == 3 and shape[:2] == tuple(ids.shape):
        head_dim = shape[2]
    elif (ids.ndim == 2 and len(shape) == 2 and shape[0] == ids.shape[0] and ids.shape[1]
          and shape[1] % ids.shape[1] == 0):
        head_dim = shape[1] // ids.shape[1]
    else:
        wanted = "[N, D]" if ids.ndim == 1 else "[T, H, D] or [T, H * D]"
        raise ValueError(f"grad_out must have shape {wanted} for ids of shape "
                         f"{tuple(ids.shape)}, got {shape}")
    grad = grad_out.reshape(count, head_dim)
    return ids.reshape(count), float32_values(grad, fmt)


@njit(cache=True, nogil=True, parallel=True)
def all_finite(grad: np.ndarray) -> bool:
    """Whether every value of a float32 ``[N, D]`` array is finite (``x - x`` is 0 for those,
    NaN for infinities and NaNs: a branch-free, vectorised pass)."""
    bad = 0
    for i in prange(grad.shape[0]):
        acc = np.float32(0.0)
        for d in range(grad.shape[1]):
            acc += grad[i, d] - grad[i, d]
        if acc != 0:
            bad += 1
    return bad == 0


def check_finite(grad) -> None:
    """Non-finite gradients are refused before any row changes (a documented choice)."""
    if isinstance(grad, np.ndarray):
        finite = all_finite(np.ascontiguousarray(grad))
    else:  # CuPy: finite float32 values cannot overflow a float64 sum
        finite = bool(np.isfinite(float(grad.sum(dtype=np.float64))))
    if not finite:
        raise ValueError("grad_out holds NaN or infinite values: the step is refused and no row "
                         "changed")


@njit(cache=True, nogil=True, parallel=True)
def largest_magnitude(grad: np.ndarray) -> float:
    """The largest magnitude of a finite float32 ``[N, D]`` array (0 when empty)."""
    top = np.zeros(grad.shape[0], np.float32)
    for i in prange(grad.shape[0]):
        for d in range(grad.shape[1]):
            top[i] = max(top[i], abs(grad[i, d]))
    return float(top.max()) if grad.shape[0] else 0.0


# Below this bound no float64 sum of a row's terms rounds to an infinite float32 (FLT_MAX ~ 2**128).
SAFE_SUM = 2.0**127


def check_row_sums(grad: np.ndarray, order: np.ndarray, starts: np.ndarray) -> None:
    """Finite float32 terms whose float64 sum for one row rounds past float32's range are
    refused before any row changes (the update would write infinite rows); the sums are only
    computed when the largest term times the longest run could reach that range."""
    if starts.shape[0] < 2:
        return
    longest = int(np.diff(starts).max())
    if longest * largest_magnitude(grad) < SAFE_SUM:
        return
    sums = np.empty((starts.shape[0] - 1, grad.shape[1]), np.float32)
    backward_numba.segment_sums(grad, order, starts, sums)
    if not all_finite(sums):
        raise ValueError("grad_out's terms for one row sum past float32's range (finite terms, "
                         "an infinite sum): the step is refused and no row changed")
