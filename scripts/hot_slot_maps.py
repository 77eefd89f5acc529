"""Measure the id -> hot slot maps the hot-row tier could use, on the CPU with Numba.

Candidates: a binary search in the sorted hot ids, an open-addressing hash table (linear
probing, Fibonacci hashing, key and slot packed in one uint64, load <= 0.7) and the bitmap plus
per-word rank of ``ngram_cupy.tables.hot_rows`` (the one the library uses). For 1e5, 1e6 and 1e7 hot
rows of the released table (320,001,536 rows) it prints nanoseconds per lookup for hot ids and
for random (nearly all cold) ids, single-threaded, and each map's memory.

    python scripts/hot_slot_maps.py [K ...]
"""

from __future__ import annotations

import sys
import time

import numpy as np
from numba import int64, njit, uint64

from ngram_cupy.tables.hot_rows import build_map, hot_slot

RELEASED_ROWS = 320_001_536
EMPTY = np.uint64(0xFFFFFFFFFFFFFFFF)


@njit
def binary_search(keys, ids, out):
    """Slot of each id by bisection of the sorted hot ids."""
    for i in range(ids.shape[0]):
        lo, hi = 0, keys.shape[0]
        while lo < hi:
            mid = (lo + hi) >> 1
            if keys[mid] < ids[i]:
                lo = mid + 1
            else:
                hi = mid
        out[i] = lo if lo < keys.shape[0] and keys[lo] == ids[i] else -1


@njit
def hash_build(hot, bits):
    """Open-addressing table of ``(row << 32) | slot`` entries (rows below 2**32)."""
    table = np.full(1 << bits, EMPTY, dtype=np.uint64)
    mask = uint64((1 << bits) - 1)
    for slot in range(hot.shape[0]):
        key = uint64(hot[slot])
        at = (key * uint64(0x9E3779B97F4A7C15)) >> uint64(64 - bits)
        while table[at] != EMPTY:
            at = (at + uint64(1)) & mask
        table[at] = (key << uint64(32)) | uint64(slot)
    return table


@njit
def hash_lookup(table, bits, ids, out):
    """Slot of each id by linear probing."""
    mask = uint64(table.shape[0] - 1)
    for i in range(ids.shape[0]):
        key = uint64(ids[i])
        at = (key * uint64(0x9E3779B97F4A7C15)) >> uint64(64 - bits)
        out[i] = -1
        while table[at] != EMPTY:
            if (table[at] >> uint64(32)) == key:
                out[i] = int64(table[at] & uint64(0xFFFFFFFF))
                break
            at = (at + uint64(1)) & mask


@njit
def bitmap_lookup(words, ranks, ids, out):
    """Slot of each id from the library's map."""
    for i in range(ids.shape[0]):
        out[i] = hot_slot(words, ranks, ids[i])


def best_seconds(fn, *args, repeats: int = 3) -> float:
    """Fastest of ``repeats`` calls after a warm-up."""
    fn(*args)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return min(times)


def main(counts: list[int], queries: int = 2_000_000) -> None:
    """Print the figures for each hot-row count."""
    rng = np.random.default_rng(0)
    for count in counts:
        hot = np.unique(rng.integers(0, RELEASED_ROWS, int(count * 1.05)))
        hot = np.sort(rng.choice(hot, count, replace=False))
        hits = hot[rng.integers(0, count, queries)]
        cold = rng.integers(0, RELEASED_ROWS, queries)
        bits = max(1, int(np.ceil(np.log2(count / 0.7))))
        table = hash_build(hot, bits)
        hot_map = build_map(hot, 0, RELEASED_ROWS)
        out = np.empty(queries, np.int64)
        memory = {"binary search": hot.nbytes, "hash": table.nbytes, "bitmap+rank": hot_map.nbytes}
        for label, ids in (("hot ", hits), ("cold", cold)):
            figures = {
                "binary search": best_seconds(binary_search, hot, ids, out),
                "hash": best_seconds(hash_lookup, table, bits, ids, out),
                "bitmap+rank": best_seconds(bitmap_lookup, *hot_map, ids, out),
            }
            if label == "hot ":
                assert (out == np.searchsorted(hot, hits)).all()
            print(f"K={count:>11,} {label} ids: " + "  ".join(
                f"{name} {seconds / queries * 1e9:6.1f} ns" for name, seconds in figures.items()))
        print(f"K={count:>11,} memory:   " + "  ".join(
            f"{name} {nbytes / 1e6:.1f} MB" for name, nbytes in memory.items()), flush=True)


if __name__ == "__main__":
    main([int(float(a)) for a in sys.argv[1:]] or [100_000, 1_000_000, 10_000_000])
