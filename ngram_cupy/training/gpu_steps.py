"""Row optimizer steps where the GPU is involved.

- A table in GPU memory (placement ``"gpu"``): the ids are grouped by CuPy's stable sort, each
  row's gradient summed by the backward's kernel and updated by ``updates_cuda``'s, all on the
  call's stream, which the step then waits for: every later lookup, on any stream, sees the new
  rows. Host inputs are uploaded first.
- A table in host memory given GPU gradients: each row's gradient is summed on the GPU (the
  CPU's bits), only the distinct rows (``[U, D]``, not ``[N, D]``) are copied to the host, and
  the host kernel applies them there (the nanochat design).
"""

from __future__ import annotations

import numpy as np

from ..runtime.backends import DEVICE, HOST, bind, cuda_stream
from .backward import row_gradients
from .inputs import check_finite, check_owned_ids, flat_inputs
from .sparse_rows import SparseRows


def checked_inputs(optimizer, call):
    """``(flat ids, float32 grad [N, D])`` of a bound ``step_from_output_grad`` call, checked
    against the optimizer's table (head_dim, owned rows, finite values)."""
    table = optimizer.table
    flat, grad = flat_inputs(call["ids"], call["grad_out"], call.formats.get("grad_out"))
    if grad.shape[1] != table.head_dim:
        raise ValueError(f"grad_out has {grad.shape[1]} values per head, the table "
                         f"{table.head_dim}")
    check_owned_ids(call["ids"], table)
    check_finite(grad)
    return flat, grad


def host_rows_of_device_grad(optimizer, call) -> SparseRows:
    """The rows and summed gradients of GPU ``ids`` / ``grad_out`` (a bound call), copied to
    the host for a table in host memory."""
    flat, grad = checked_inputs(optimizer, call)
    with call.on():
        rows = row_gradients(flat, DEVICE.contiguous(grad), optimizer.table.row_start, None)
        return SparseRows(rows.indices.get(stream=call.stream),
                          rows.values.get(stream=call.stream))


def host_sparse_rows(grads: SparseRows) -> SparseRows:
    """GPU sparse row gradients copied to the host (a table in host memory)."""
    call = bind(indices=grads.indices, values=grads.values)
    if call.side is HOST:
        return SparseRows(call["indices"], call["values"])
    with call.on():
        return SparseRows(call["indices"].get(stream=call.stream),
                          call["values"].get(stream=call.stream))


def step(optimizer, grads: SparseRows) -> None:
    """``optimizer.step(grads)`` for a table in GPU memory (grads on either side)."""
    call = bind(indices=grads.indices, values=grads.values)
    indices, values = call["indices"], call["values"]
    table = optimizer.table
    if indices.ndim != 1 or indices.dtype.kind not in "iu":
        raise TypeError(f"grads.indices must be a 1-D integer array, got {indices.dtype} "
                        f"{tuple(indices.shape)}")
    if values.dtype != np.float32 or values.shape != (indices.shape[0], table.head_dim):
        raise ValueError(f"grads.values must be float32 [{indices.shape[0]}, "
                         f"{table.head_dim}], got {values.dtype} {tuple(values.shape)}")
    with device_of(table):
        stream = call.stream if call.side is DEVICE else cuda_stream()
        with DEVICE.on(stream):
            indices = DEVICE.asarray(indices).astype(np.int64)
            if indices.size > 1 and not bool((indices[1:] > indices[:-1]).all()):
                raise ValueError("grads.indices must be sorted and unique (embedding_backward's)")
            check_owned_ids(indices, table, "grads.indices")
            values = DEVICE.asarray(values).copy()  # the kernel's scratch: the caller's stays
            check_finite(values)
            apply(optimizer, indices - table.row_start, values, stream)


def step_from_output_grad(optimizer, ids, grad_out) -> None:
    """``optimizer.step_from_output_grad`` for a table in GPU memory (inputs on either side)."""
    from .backward_cuda import device_order, launch_segment_sums

    call = bind(ids=ids, grad_out=grad_out)
    flat, grad = checked_inputs(optimizer, call)
    table = optimizer.table
    with device_of(table):
        stream = call.stream if call.side is DEVICE else cuda_stream()
        with DEVICE.on(stream):
            flat, grad = DEVICE.asarray(flat), DEVICE.contiguous(DEVICE.asarray(grad))
            order, unique, starts = device_order(flat, table.row_start)
            values = DEVICE.empty((unique.shape[0], table.head_dim), np.float32)
            launch_segment_sums(grad, order, starts, values, stream)
            check_finite(values)  # finite terms whose sum for a row overflows float32
            apply(optimizer, unique - table.row_start, values, stream)


def device_of(table):
    """The table's GPU as CuPy's current device."""
    return table.storage.cold.device_view.device


def apply(optimizer, local, values, stream) -> None:
    """Launch the update kernel on ``stream`` after the lookups still reading the rows, then
    wait for it (later lookups on any stream see the new rows). Stochastic rounding hashes the
    global row (``row_start`` + local): a shard rounds as the whole table would."""
    from .updates_cuda import launch_update_rows

    table = optimizer.table
    table.storage.cold.wait_for_readers("update the rows")
    step_count = optimizer.steps + 1
    empty = DEVICE.empty((0, 1), np.float32)
    states = [optimizer.state[key] for key, _ in optimizer.state_widths] + [empty, empty]
    launch_update_rows(optimizer.kind, optimizer.rows, optimizer.code, local, values,
                       states[0], states[1], DEVICE.asarray(optimizer.hyper(step_count)),
                       optimizer.stochastic_rounding, optimizer.seed, step_count,
                       row_start=table.row_start, stream=stream)
    stream.synchronize()
    optimizer.steps = step_count
