"""``embedding_backward``: the gradient of a table lookup as sparse rows (deterministic)."""

from __future__ import annotations

import numpy as np

from ..runtime.backends import DEVICE, bind
from ..runtime.checks import check_integer
from . import backward_numba
from .inputs import check_ids_inside, flat_inputs
from .sparse_rows import SparseRows


def grouped(ids, low: int, rows: int | None):
    """``(order, unique, starts)`` of flat ids on their side (``rows``: the span of the ids)."""
    if not isinstance(ids, np.ndarray):
        from .backward_cuda import device_order

        return device_order(ids, low)
    flat = ids.astype(np.int64, copy=False)
    if rows is None:
        rows = int(flat.max()) + 1 - low if flat.size else 0
    return backward_numba.sorted_order(flat, low, rows)


def row_gradients(ids, grad, low: int, rows: int | None) -> SparseRows:
    """Sum checked flat ``grad`` [N, D] (float32) per distinct id (all inside the rows)."""
    order, unique, starts = grouped(ids, low, rows)
    if isinstance(ids, np.ndarray):
        values = np.empty((unique.shape[0], grad.shape[1]), np.float32)
        backward_numba.segment_sums(np.ascontiguousarray(grad), order, starts, values)
        return SparseRows(unique, values)
    from .backward_cuda import launch_segment_sums

    values = DEVICE.empty((unique.shape[0], grad.shape[1]), np.float32)
    launch_segment_sums(DEVICE.contiguous(grad), order, starts, values)
    return SparseRows(unique, values)


def embedding_backward(ids, grad_out, num_rows: int | None = None) -> SparseRows:
    """The gradient of looking ``ids`` up (``[N]`` or ``[T, H]``) given the output gradient
    ``grad_out`` (``[N, D]``, ``[T, H, D]`` or ``[T, H * D]``; float32, bfloat16 or float16;
    NumPy, CuPy or torch): the distinct rows and their summed gradients (float64 sums in the
    ids' order, rounded once to float32: the same bits on any thread count and device).
    ``num_rows`` bounds the ids (an IndexError names the first one outside)."""
    call = bind(ids=ids, grad_out=grad_out)
    flat_ids, grad = flat_inputs(call["ids"], call["grad_out"], call.formats.get("grad_out"))
    if num_rows is not None:
        num_rows = check_integer("num_rows", num_rows, 0)
        check_ids_inside(call["ids"], num_rows)
    else:
        check_ids_inside(call["ids"], 1 << 62)
    with call.on():
        rows = row_gradients(flat_ids, grad, 0, num_rows)
    if call.torch:
        return SparseRows(call.side.to_torch(rows.indices, stream=call.stream),
                          call.side.to_torch(rows.values, stream=call.stream))
    return rows
