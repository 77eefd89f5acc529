"""Bench section ``packed-rows``: CPU gathers of block-scaled rows packed with their scales (one
record a row) against the same rows in two arrays and against fp8 rows, idle and beside one
busy core, in alternating pairs (``paired``)."""

from __future__ import annotations

from contextlib import AbstractContextManager
from functools import partial

import ml_dtypes
import numpy as np

import ngram_cupy as nc
from ngram_cupy.codecs.records import record_bytes
from ngram_cupy.formats import storage_format
from ngram_cupy.tables.storage.cpu import CpuStorage

from .conditions import busy_processes, idle
from .data import RELEASED_HEADS
from .report import Row, Section
from .timers import paired

ENGRAM_HEAD_DIM = 256  # DeepSeek Engram's MXFP8 rows: 256 values, 8 UE8M0 scales


def loads() -> list[tuple[str, AbstractContextManager]]:
    """The two conditions the section runs under."""
    return [("idle", idle), ("1 core busy", partial(busy_processes, 1))]


def fp8_table(rng, rows: int, head_dim: int) -> nc.EmbeddingTable:
    """Random finite fp8 rows."""
    bits = rng.integers(0, 0x7F, (rows, head_dim), dtype=np.uint8)
    return nc.EmbeddingTable(bits.view(ml_dtypes.float8_e4m3fn), scale=0.5)


def separate_table(codes: np.ndarray, scales: np.ndarray, name: str, scale) -> nc.EmbeddingTable:
    """The rows and scales in two arrays (the layout before packing)."""
    fmt = storage_format(name)
    storage = CpuStorage(codes.view(fmt.dtype), fmt, scales)
    return nc.EmbeddingTable(storage, scale)


def bench_packed_rows(quick: bool) -> Section:
    """Packed NVFP4 (head_dim 160: 96-byte records) against the same rows unpacked (80 + 10
    bytes) and fp8 rows of 160 bytes; packed MXFP8 (head_dim 256: 272-byte records) against fp8
    rows of 256 bytes; all to bf16."""
    rng = np.random.default_rng(7)
    rows = 1 << (20 if quick else 22)
    num_tokens = 4096 if quick else 65536
    section = Section(f"Packed block-scaled rows, CPU gather (Numba): {rows:,} rows, "
                      f"{num_tokens:,} tokens x {RELEASED_HEADS} heads -> bf16", "cpu")
    batches = [rng.integers(0, rows, (num_tokens, RELEASED_HEADS)) for _ in range(2)]

    def rotate(table, out):
        turn = iter(range(1 << 62))
        return lambda: table.lookup(batches[next(turn) % 2], out=out)

    for name, head_dim in (("nvfp4", 160), ("mxfp8", ENGRAM_HEAD_DIM)):
        fmt = storage_format(name)
        codes = rng.integers(0, 256 if name == "nvfp4" else 0x7F,
                             (rows, fmt.row_width(head_dim)), dtype=np.uint8)
        scales = rng.integers(0, 0x7F, (rows, fmt.scale_width(head_dim)), dtype=np.uint8) \
            if name == "nvfp4" else rng.integers(112, 135, (rows, head_dim // 32), dtype=np.uint8)
        scale = 0.5 if name == "nvfp4" else None
        weight = codes if name == "nvfp4" else codes.view(ml_dtypes.float8_e4m3fn)
        packed = nc.EmbeddingTable(weight, dtype=name, block_scales=scales, scale=scale)
        separate = separate_table(codes, scales, name, scale)
        fp8 = fp8_table(rng, rows, head_dim)
        out = np.empty((num_tokens, RELEASED_HEADS * head_dim), ml_dtypes.bfloat16)
        record = record_bytes(fmt, head_dim)
        for condition, load in loads():
            with load():
                p, e, to_fp8 = paired(rotate(packed, out), rotate(fp8, out), rounds=11)
                _, s, to_separate = paired(rotate(packed, out), rotate(separate, out),
                                           rounds=11)
            moved = batches[0].size * record + out.nbytes
            section.rows.append(Row(
                case=f"{name} packed ({record} B/row), {condition}", seconds=p,
                rate=f"{moved / p / 1e9:.2f} GB/s", tokens=num_tokens, condition=condition,
                notes=f"packed / fp8 ({head_dim} B/row) {to_fp8:.2f} (fp8 {e * 1e3:,.1f} ms); "
                      f"packed / two arrays ({fmt.row_bytes(head_dim)} B/row) {to_separate:.2f} "
                      f"(two arrays {s * 1e3:,.1f} ms)"))
        del packed, separate, fp8, codes, scales, weight, out
    return section
