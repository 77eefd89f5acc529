"""The rows of a table an optimizer may update in place, and state arrays placed beside them."""

from __future__ import annotations

import json

import numpy as np

from ..tables import shared_memory
from ..tables.storage.tiered import TieredStorage

TRAINABLE = ("float32", "bfloat16")


def base_storage(table):
    """The storage holding the table's own rows (the cold rows under a hot tier)."""
    storage = table.storage
    return storage.cold if isinstance(storage, TieredStorage) else storage


def check_trainable(table) -> None:
    """A ValueError saying why a table cannot be trained (format, placement, closed)."""
    if table.format.name not in TRAINABLE:
        raise ValueError(f"{table.format.name} tables cannot be trained: their values are "
                         f"quantised (a small update rounds back to the same code, and block "
                         f"scales would need refitting); train a float32 or bfloat16 table and "
                         f"quantise it afterwards")
    if getattr(table, "closed", False):
        raise ValueError("the table is closed: its rows can no longer be updated")
    storage = base_storage(table)
    if storage.placement == "mmap":
        raise ValueError("placement='mmap' tables are read-only (the rows are the checkpoint "
                         "files' pages): load the table into 'cpu', 'pinned' or 'shared' memory "
                         "to train it")
    if storage.placement == "gpu":
        raise ValueError("training tables in GPU memory is not supported yet: place the table "
                         "on 'cpu', 'pinned' or 'shared'")
    if storage.placement == "shared" and not storage.segment.attached:
        raise ValueError("the table is closed: its shared segment is detached")
    if storage.placement not in ("shared",) and not storage.writable:
        raise ValueError("the table's rows are read-only (a read-only array was adopted)")


def writable_rows(table) -> np.ndarray:
    """The raw rows (uint32 for float32, uint16 for bfloat16) ``[num_rows, head_dim]``, in place:
    a shared table's segment mapped writable (Hogwild: every process updates it)."""
    check_trainable(table)
    storage = base_storage(table)
    raw = table.format.raw
    if storage.placement == "shared":
        count = table.num_rows * table.head_dim
        return np.frombuffer(storage.segment.memory, raw, count=count).reshape(
            table.num_rows, table.head_dim)
    return storage.host_view.view(raw)


def state_array(table, name: str, width: int):
    """A zeroed float32 ``[num_rows, width]`` optimizer state beside the rows: in the node-wide
    segment named after the table's and ``name`` for a shared table (every process attaches the
    same one), else in this process's memory; and the segment to keep attached (or None)."""
    shape = (table.num_rows, width)
    storage = base_storage(table)
    if storage.placement != "shared" or not storage.segment.shared or not table.num_rows * width:
        return np.zeros(shape, np.float32), None
    key = json.dumps({"state_of": storage.segment.name, "name": name, "shape": shape})

    def fill(memory) -> None:
        np.frombuffer(memory, np.float32, count=shape[0] * shape[1])[:] = 0.0

    segment = shared_memory.attach(key, 4 * shape[0] * shape[1], fill)
    array = np.frombuffer(segment.memory, np.float32, count=shape[0] * shape[1]).reshape(shape)
    return array, segment


def refresh_hot(table, local_rows: np.ndarray) -> None:
    """Copy updated rows into a tiered table's hot tier (its hot copies stay coherent)."""
    storage = table.storage
    if not isinstance(storage, TieredStorage) or not local_rows.size:
        return
    slots = np.searchsorted(storage.hot_rows, local_rows)
    slots = np.minimum(slots, storage.hot_rows.shape[0] - 1)
    hit = storage.hot_rows[slots] == local_rows if storage.hot_rows.size else slots < 0
    if hit.any():
        raw = storage.host_view.view(storage.cold.format.raw)
        storage.host_hot[slots[hit]] = raw[local_rows[hit]]
        if storage.device_hot is not None:
            storage.refresh()
