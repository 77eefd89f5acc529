"""Argument checks shared by every backend: clear errors naming the argument, never a crash.

They read only metadata (shape, dtype, flags), so they cost nothing on GPU arrays.
"""

from __future__ import annotations

import math

import numpy as np

from .backends import where

INDEX_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))


def check_index_array(name: str, array, ndim: int) -> None:
    """``array`` must have ``ndim`` dimensions and an int32 or int64 dtype."""
    if array.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(array.shape)}")
    if np.dtype(array.dtype) not in INDEX_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got {array.dtype}")


def check_out(name: str, out, shape: tuple[int, ...], dtype) -> None:
    """An ``out=`` destination must have exactly this shape and dtype, C-contiguous."""
    if tuple(out.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(out.shape)}")
    if np.dtype(out.dtype) != np.dtype(dtype):
        raise TypeError(f"{name} must have dtype {np.dtype(dtype)}, got {out.dtype}")
    if not out.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")
    if not getattr(out.flags, "writeable", True):
        raise ValueError(f"{name} must be writable")


def check_destination(name: str, value) -> None:
    """An ``out=`` argument must be an array the call writes into: a list or tuple would be
    copied into a new array and the caller's object never filled."""
    if value is not None and where(value) is None:
        raise TypeError(f"{name} must be an array (NumPy, CuPy, torch, DLPack), got "
                        f"{type(value).__name__}")


def check_integer(name: str, value, minimum: int | None = None) -> int:
    """``value`` as a Python int: a TypeError for non-integers (bools included), a ValueError
    below ``minimum``; both name the argument. A 0-d integer array (a scalar read from an
    ``.npz``) counts as its integer."""
    if isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind in "iu":
        value = value[()]
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    return int(value)


def check_scale(name: str, value: float) -> float:
    """A table scale must be finite and positive: zero gives an all-zero table, NaN or an
    infinity NaN rows, a negative one flips every sign (loaders and constructors alike)."""
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite positive number, got {value}")
    return value


def check_geometry(num_rows, head_dim, row_start, total_rows) -> None:
    """A row shard's geometry: integers, non-negative, the owned rows inside the table."""
    total_rows = num_rows if total_rows is None else total_rows
    for name, value in (("num_rows", num_rows), ("head_dim", head_dim),
                        ("row_start", row_start), ("total_rows", total_rows)):
        check_integer(name, value)
    if min(num_rows, head_dim) < 0:
        raise ValueError(f"num_rows and head_dim must be non-negative, got {num_rows} and "
                         f"{head_dim}")
    if not 0 <= row_start <= row_start + num_rows <= total_rows:
        raise ValueError(f"rows [{row_start}, {row_start + num_rows}) must lie within [0, "
                         f"total_rows={total_rows})")


def check_apart(name: str, out, memory) -> None:
    """A ValueError when ``out`` shares memory with one of the arrays ``memory`` (None skipped):
    a lookup writing into the table's own rows would overwrite them as it reads them."""
    for array in memory:
        if array is not None and overlaps(out, array):
            raise ValueError(f"{name} shares memory with the table's rows or scales: the lookup "
                             f"would overwrite the table; pass an {name} of its own")


def overlaps(first, second) -> bool:
    """Whether two arrays' memory ranges meet: NumPy's bounds check on the host, the device
    pointer ranges on the GPU (arrays on different sides never meet)."""
    if isinstance(first, np.ndarray) or isinstance(second, np.ndarray):
        both = isinstance(first, np.ndarray) and isinstance(second, np.ndarray)
        return both and bool(np.may_share_memory(first, second))
    start, other = first.data.ptr, second.data.ptr
    return start < other + second.nbytes and other < start + first.nbytes
