"""Argument checks shared by every backend: clear errors naming the argument, never a crash.

Shape and dtype checks read only metadata, so they cost nothing on GPU arrays; the value checks
of ``query_start_loc`` need host data and run on the CPU path only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .backends import where

if TYPE_CHECKING:
    from ..hashing.layout import LayerLayout

INDEX_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))


def check_index_array(name: str, array, ndim: int) -> None:
    """``array`` must have ``ndim`` dimensions and an int32 or int64 dtype."""
    if array.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(array.shape)}")
    if np.dtype(array.dtype) not in INDEX_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got {array.dtype}")


def check_batch(layout: LayerLayout, input_ids, query_start_loc, ngram_context) -> tuple[int, int]:
    """Check shapes and dtypes of a packed batch; return ``(num_tokens, num_requests)``."""
    check_index_array("input_ids", input_ids, 1)
    check_index_array("query_start_loc", query_start_loc, 1)
    check_index_array("ngram_context", ngram_context, 2)
    num_tokens = input_ids.shape[0]
    if query_start_loc.shape[0] < 1:
        raise ValueError("query_start_loc must hold at least one entry (0 for an empty batch)")
    num_requests = query_start_loc.shape[0] - 1
    width = layout.ngram_size - 1
    if ngram_context.shape[1] != width or ngram_context.shape[0] < num_requests:
        raise ValueError(
            f"ngram_context must have shape [R' >= {num_requests}, ngram_size - 1 = {width}], "
            f"got {tuple(ngram_context.shape)}"
        )
    return num_tokens, num_requests


def check_query_start_loc_values(query_start_loc: np.ndarray, num_tokens: int) -> None:
    """Host-side: ``0 = q_0 <= q_1 <= ... <= q_R = T``, so no kernel reads out of bounds."""
    if query_start_loc[0] != 0:
        raise ValueError(f"query_start_loc must start at 0, got {int(query_start_loc[0])}")
    if query_start_loc[-1] != num_tokens:
        raise ValueError(
            f"query_start_loc must end at the number of tokens {num_tokens}, "
            f"got {int(query_start_loc[-1])}"
        )
    if query_start_loc.shape[0] > 2 and np.any(query_start_loc[1:] < query_start_loc[:-1]):
        raise ValueError("query_start_loc must be non-decreasing")


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
    below ``minimum``; both name the argument."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    return int(value)
