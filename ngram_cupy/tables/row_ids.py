"""Row ids outside the whole table: one IndexError, naming the first one, for every path.

An id in ``[0, total_rows)`` that another shard owns gives a zero row (row sharding sums
exactly); an id below 0 or at or above ``total_rows`` is the caller's bug, refused. The gathers
find the first such id in their own loop (the CPU gather per work block, the GPU kernels with
an atomic minimum on a word) and the Python side raises after: ``first_bad`` reads what they
recorded, ``row_id_error`` builds the error. ``check_row_ids`` is the same check as a pass of its
own, for paths without a gather loop to fold it into (gradients, optimizer steps).
"""

from __future__ import annotations

import numpy as np

# What a gather that finds nothing leaves: -1 in the CPU gather's per-block positions, all bits
# set in the GPU kernels' word (an unsigned minimum).
NO_BAD_ID = -1
NO_BAD_WORD = np.uint64(0xFFFF_FFFF_FFFF_FFFF)
# ``total_rows`` passed to the kernels to leave ids unchecked (direct gathers of a bare shard).
UNCHECKED = -1


def row_id_error(ids, position: int, total_rows: int, name: str = "ids",
                 held: tuple[int, int] | None = None, owned: bool = False) -> IndexError:
    """The IndexError for ``ids`` (any shape, NumPy / CuPy / torch) whose element at flat
    (row-major) ``position`` is the first outside ``[0, total_rows)`` (``owned``: outside
    ``held``, the rows an optimizer may update): the one wording of every path. ``held`` is the
    global rows ``[start, stop)`` the table holds; only a sharded table's error (``held`` not all
    of ``[0, total_rows)``) speaks of shards."""
    shape = tuple(ids.shape)
    index = ", ".join(str(int(i)) for i in np.unravel_index(position, shape)) if shape else ""
    value = int(ids.reshape(-1)[position])
    sharded = held is not None and tuple(held) != (0, total_rows)
    span = f"the table's rows [0, {total_rows})"
    note = ""
    if sharded and owned:
        span = f"this shard's rows [{held[0]}, {held[1]}) of the table's [0, {total_rows})"
    elif sharded:
        note = (f"; this shard holds rows [{held[0]}, {held[1]}), and ids of other shards give "
                "zero rows")
    return IndexError(f"{name}[{index}] = {value} is outside {span} (the first such id, at flat "
                      f"position {position}){note}")


def first_bad(recorded) -> int:
    """The first bad position from what a gather recorded: the CPU gather's per-block positions
    (int64, ``NO_BAD_ID`` for none, blocks in id order) or a GPU word (uint64, all bits for
    none, NumPy or already copied to the host); -1 when every id was inside."""
    recorded = np.asarray(recorded)
    if recorded.dtype == np.uint64:
        word = int(recorded.reshape(-1)[0])
        return -1 if word == int(NO_BAD_WORD) else word
    found = np.flatnonzero(recorded != NO_BAD_ID)
    return int(recorded[found[0]]) if found.size else -1


def raise_recorded(ids, recorded, total_rows: int, name: str = "ids",
                   held: tuple[int, int] | None = None) -> None:
    """Raise ``row_id_error`` when a gather of ``ids`` recorded a bad position (``first_bad``)."""
    position = first_bad(recorded)
    if position >= 0:
        raise row_id_error(ids, position, total_rows, name, held)


def check_row_ids(ids, total_rows: int, name: str = "ids",
                  held: tuple[int, int] | None = None) -> None:
    """Refuse ids outside ``[0, total_rows)`` (NumPy, CuPy or torch; an IndexError naming the
    first): a vectorised pass, for paths that have no gather loop to fold the check into."""
    flat = ids.reshape(-1)
    bad = (flat < 0) | (flat >= total_rows)
    if bad.any():  # nonzero, not argmax: torch has no argmax of booleans
        raise row_id_error(ids, int(bad.nonzero()[0][0]), total_rows, name, held)
