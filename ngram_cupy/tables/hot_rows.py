"""The hot-row tier's map from a table row to its slot among the hot rows: a bitmap plus rank.

Hot rows are a sorted set of a table's rows copied into a faster tier (GPU memory) in order, so
the slot of a hot row is its rank among them. The map is one bit per local row (``words``,
uint64) and the count of hot rows before each word (``ranks``, uint32): a row's slot is its
word's rank plus the set bits below it in the word, and a row whose bit is clear is cold. That is
one load for a cold row and two independent ones for a hot row, with no data-dependent loop (no
warp divergence on the GPU), at a fixed 1.5 bits per table row (60 MB for the released model's
320 M rows, 0.12% of its fp8 table). Measured on the CPU (``scripts/hot_slot_maps.py``) against a
binary search in the sorted ids (log2(K) dependent loads: 5 to 25 times slower) and an
open-addressing hash table (faster on hot ids, and overall at 1e5 hot rows, but 2.5 to 3.5 times
slower on the cold ids that most lookups are at 1e6 and 1e7 hot rows, and 134 MB at 1e7).

``hot_slot`` is written once, for the Numba CPU gather, Numba CUDA kernels and the simulator;
``kernels/hot_rows.cuh`` is its CUDA C twin.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from llvmlite import ir
from numba import int64, njit, types, uint64
from numba.core.extending import intrinsic, overload

from ..runtime.jitable import inline_jitable

WORD_BITS = 64


class HotRowMap(NamedTuple):
    """The slot map of a table's hot rows: ``words[(num_rows + 63) // 64]`` uint64 bits and
    ``ranks`` (uint32, the same length): hot rows before each word."""

    words: np.ndarray
    ranks: np.ndarray

    @property
    def nbytes(self) -> int:
        """Memory of the map."""
        return self.words.nbytes + self.ranks.nbytes


def map_nbytes(num_rows: int) -> int:
    """Bytes of the slot map of a table of ``num_rows`` rows (any number of hot rows)."""
    return -(-num_rows // WORD_BITS) * (8 + 4)


def popcount(x):
    """Set bits of a uint64 (plain Python: the CUDA simulator)."""
    return int64(bin(int(x)).count("1"))


@intrinsic
def _popcount_llvm(typingctx, x):
    """``popcount`` as one instruction: ``popcnt`` on CPUs, ``popc.b64`` in PTX."""

    def codegen(context, builder, signature, args):
        count = builder.ctpop(args[0])
        return builder.zext(count, ir.IntType(64)) if count.type.width < 64 else count

    return types.int64(types.uint64), codegen


@overload(popcount)
def _popcount_compiled(x):
    """Compiled targets count with the instruction."""
    return lambda x: _popcount_llvm(uint64(x))


@inline_jitable
def hot_slot(words, ranks, local):
    """The hot slot of local row ``0 <= local < num_rows``, or -1 when the row is cold."""
    index = local >> 6
    word = uint64(words[index])
    bit = uint64(1) << uint64(local & 63)
    if (word & bit) == uint64(0):
        return int64(-1)
    return int64(ranks[index]) + popcount(word & (bit - uint64(1)))


@njit(cache=True, nogil=True)
def _fill(local_rows, words, ranks):
    """Set the bits of ``local_rows`` and the running ranks."""
    for row in local_rows:
        words[row >> 6] |= uint64(1) << uint64(row & 63)
    total = 0
    for index in range(words.shape[0]):
        ranks[index] = total
        total += popcount(words[index])


def check_hot_rows(hot_rows, row_start: int, num_rows: int, name: str = "hot_rows") -> np.ndarray:
    """``hot_rows`` as a 1-D int64 NumPy array of sorted, unique rows of ``[row_start,
    row_start + num_rows)``; ValueError / TypeError naming ``name`` otherwise."""
    if hasattr(hot_rows, "get") and not isinstance(hot_rows, np.ndarray):  # CuPy
        hot_rows = hot_rows.get()
    elif hasattr(hot_rows, "numpy") and hasattr(hot_rows, "cpu"):  # torch
        hot_rows = hot_rows.cpu().numpy()
    array = np.asarray(hot_rows)
    if array.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {array.shape}")
    if array.size and array.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integer row ids, got {array.dtype}")
    if array.dtype.kind == "u" and array.size and array.max() > np.iinfo(np.int64).max:
        raise ValueError(f"{name} holds ids past int64")
    array = array.astype(np.int64, copy=False)
    if array.size == 0:
        return array
    if np.any(array[1:] <= array[:-1]):
        raise ValueError(f"{name} must be sorted and unique")
    stop = row_start + num_rows
    if array[0] < row_start or array[-1] >= stop:
        bad = int(array[0] if array[0] < row_start else array[-1])
        raise ValueError(f"{name} must lie within the table's rows [{row_start}, {stop}), got "
                         f"{bad}")
    return array


def build_map(hot_rows: np.ndarray, row_start: int, num_rows: int) -> HotRowMap:
    """The slot map of checked ``hot_rows`` (global ids) of a table owning ``[row_start,
    row_start + num_rows)``: hot row ``hot_rows[s]`` gets slot ``s``."""
    count = -(-num_rows // WORD_BITS)
    if hot_rows.size >= 1 << 32:
        raise ValueError(f"hot_rows must hold fewer than 2**32 rows, got {hot_rows.size}")
    words = np.zeros(count, dtype=np.uint64)
    ranks = np.zeros(count, dtype=np.uint32)
    _fill(hot_rows - row_start, words, ranks)
    return HotRowMap(words, ranks)
