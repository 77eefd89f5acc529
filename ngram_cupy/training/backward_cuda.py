"""GPU kernel of the backward: after a stable sort of the ids (CuPy), one thread per (row, value)
sums that value's gradients in float64 in the sorted order, as the CPU does: the same bits."""

from __future__ import annotations

from numba import cuda, float32, float64

from ..runtime.cuda_launch import NumbaKernel

THREADS = 128


def _segment_sums_kernel(grad, order, starts, out):
    """``out[u, d]``: the float64 sum of ``grad[order[k], d]`` over row ``u``'s run, rounded."""
    i = cuda.grid(1)
    width = out.shape[1]
    if i < out.shape[0] * width:
        u = i // width
        d = i - u * width
        acc = float64(0.0)
        for k in range(starts[u], starts[u + 1]):
            acc += float64(grad[order[k], d])
        out[u, d] = float32(acc)


segment_sums_kernel = NumbaKernel(_segment_sums_kernel)


def launch_segment_sums(grad, order, starts, out, stream=None) -> None:
    """Sum each run of ``order`` (``starts``: [U + 1]) of ``grad`` [N, D] into ``out`` [U, D]."""
    total = out.shape[0] * out.shape[1]
    if total:
        segment_sums_kernel((total + THREADS - 1) // THREADS, THREADS,
                            (grad, order, starts, out), stream)


def device_order(ids, low: int):
    """``(order, unique, starts)`` of CuPy ids by CuPy's stable sort."""
    import cupy

    order = cupy.argsort(ids, kind="stable") if ids.size else cupy.zeros(0, cupy.int64)
    ordered = ids[order].astype(cupy.int64)
    firsts = cupy.flatnonzero(ordered[1:] != ordered[:-1]) + 1
    edges = cupy.asarray([0, ids.shape[0]], cupy.int64)
    starts = cupy.concatenate((edges[:1], firsts.astype(cupy.int64), edges[1:]))
    unique = ordered[starts[:-1]] if ids.size else ordered
    return order.astype(cupy.int64), unique, starts if ids.size else edges[:1]
