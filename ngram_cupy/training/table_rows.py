"""The rows of a table an optimizer may update in place, and state arrays placed beside them."""

from __future__ import annotations

import json

import numpy as np

from ..formats import FORMATS
from ..memory import shared as shared_memory
from .updates_numba import ROW_FORMATS

# The formats a row optimizer updates in place: those its kernel loads and stores.
TRAINABLE = tuple(FORMATS[code] for code in ROW_FORMATS)
TRAINABLE_NAMES = " or ".join(fmt.name for fmt in TRAINABLE)


def training_refusal(table) -> str | None:
    """Why a table cannot be trained, or None: the one rule every face asks (its format, whether
    it is closed, and its storage's own answer: a shared segment trains, Hogwild)."""
    if table.format not in TRAINABLE:
        return (f"{table.format.name} tables cannot be trained: rows are updated in float32 and "
                f"stored as {TRAINABLE_NAMES} (a quantised value rounds a small update back to "
                f"the same code, and block scales would need refitting); train a "
                f"{TRAINABLE_NAMES} table and quantise it afterwards")
    if getattr(table, "closed", False):
        return "the table is closed: its rows can no longer be updated"
    return table.storage.cold.training_refusal()


def check_trainable(table, what: str | None = None) -> None:
    """A ValueError saying why a table cannot be trained (``training_refusal``), after
    ``what`` (the argument asking for it) when given."""
    refusal = training_refusal(table)
    if refusal is not None:
        raise ValueError(refusal if what is None else f"{what}: {refusal}")


def writable_rows(table) -> np.ndarray:
    """The raw rows (uint32 for float32, uint16 for bfloat16) ``[num_rows, head_dim]``, in place:
    a shared table's segment mapped writable (Hogwild: every process updates it)."""
    check_trainable(table)
    return table.storage.cold.training_rows()


def state_array(table, name: str, width: int):
    """A zeroed float32 ``[num_rows, width]`` optimizer state beside the rows: in the node-wide
    segment named after the table's and ``name`` for a shared table (every process attaches the
    same one), else in this process's memory; and the segment to keep attached (or None)."""
    shape = (table.num_rows, width)
    if table.storage.cold.device_resident:  # beside rows in GPU memory, on their GPU
        return device_zeros(table, shape), None
    rows_segment = table.storage.cold.shared_segment
    if rows_segment is None or not table.num_rows * width:
        return np.zeros(shape, np.float32), None
    key = json.dumps({"state_of": rows_segment.name, "name": name, "shape": shape})

    def fill(memory) -> None:
        np.frombuffer(memory, np.float32, count=shape[0] * shape[1])[:] = 0.0

    segment = shared_memory.attach(key, 4 * shape[0] * shape[1], fill)
    array = np.frombuffer(segment.memory, np.float32, count=shape[0] * shape[1]).reshape(shape)
    return array, segment


def device_zeros(table, shape: tuple[int, ...]):
    """A zeroed float32 CuPy array on the GPU of a table in GPU memory."""
    from ..runtime.backends import cupy_module

    cupy = cupy_module()
    with table.storage.cold.device_view.device:
        return cupy.zeros(shape, np.float32)


def host_copy(array) -> np.ndarray:
    """A NumPy copy of a host or CuPy array (state to hand out)."""
    return array.copy() if isinstance(array, np.ndarray) else array.get()


def on_host(array) -> np.ndarray:
    """A host array itself, or a NumPy copy of a CuPy one (rows to save)."""
    return array if isinstance(array, np.ndarray) else array.get()


def copy_into(destination, source: np.ndarray) -> None:
    """Write host ``source`` over ``destination`` (host, or CuPy: one upload), bits as they are."""
    source = np.ascontiguousarray(source).view(destination.dtype)
    if isinstance(destination, np.ndarray):
        destination[...] = source
    else:
        destination.set(source)


def restore_rows(optimizer, rows: np.ndarray) -> None:
    """Write loaded ``rows`` over the optimizer's table rows, as a step would: hot copies are
    refreshed and a pending prefetch gathers them again (it may have read the old rows)."""
    table = optimizer.table
    table.storage.cold.will_write()
    copy_into(optimizer.rows, rows)
    table.refresh_hot_rows()
    table.writers.wrote((table.row_start, table.row_start + table.num_rows))


def refresh_hot(table, local_rows: np.ndarray) -> None:
    """Copy updated rows into a tiered table's hot tier (its hot copies stay coherent)."""
    table.storage.rows_changed(local_rows)
