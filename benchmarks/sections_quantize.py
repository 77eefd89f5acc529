"""CPU quantisation: a bf16 table to fp8, NVFP4 and MXFP8 against the copy of the same bytes."""

from __future__ import annotations

import tracemalloc

import ml_dtypes
import numpy as np

import ngram_cupy as nc
from ngram_cupy.codecs.quantize import chunk_rows_for

from .data import RELEASED_HEAD_DIM
from .report import Row, Section
from .timers import paired


def extra_memory(fn) -> int:
    """Peak bytes ``fn`` allocates beyond what it returns (tracemalloc sees NumPy's buffers)."""
    tracemalloc.start()
    result = fn()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak - result.nbytes


def bench_quantize_cpu(quick: bool) -> Section:
    """``quantize_table`` of a bf16 table of the released row shape (160 values) to each format,
    timed in alternating pairs with a copy of the table's bytes (one read, one write: the memory
    floor), and its peak extra memory against one chunk's float32 values."""
    size = (64 if quick else 1024) << 20
    rows = size // (2 * RELEASED_HEAD_DIM)
    rng = np.random.default_rng(5)
    table = np.empty((rows, RELEASED_HEAD_DIM), ml_dtypes.bfloat16)
    for start in range(0, rows, 1 << 18):  # drawn in pieces: no float64 table
        piece = table[start:start + (1 << 18)]
        piece[...] = rng.standard_normal(piece.shape, np.float32).astype(ml_dtypes.bfloat16)
    target = np.empty_like(table)
    chunk = chunk_rows_for(RELEASED_HEAD_DIM, None) * RELEASED_HEAD_DIM * 4
    section = Section(f"quantize_table, CPU (Numba): a {size >> 20:,} MiB bf16 table "
                      f"({rows:,} rows x {RELEASED_HEAD_DIM}) against copying its bytes", "cpu")
    for to in ("fp8", "nvfp4", "mxfp8"):
        seconds, floor, ratio = paired(lambda to=to: nc.quantize_table(table, to),
                                       lambda: np.copyto(target, table), min_time=1.0, rounds=5)
        extra = extra_memory(lambda to=to: nc.quantize_table(table, to))
        section.rows.append(Row(
            case=f"bf16 -> {to}", seconds=seconds, rate=f"{rows / seconds / 1e6:.1f} M rows/s",
            notes=f"{ratio:.2f}x the copy floor ({floor * 1e3:,.0f} ms); peak extra memory "
                  f"{extra / 2**20:.1f} MiB = {extra / chunk:.2f}x one chunk "
                  f"({chunk / 2**20:.0f} MiB of float32)"))
    return section
