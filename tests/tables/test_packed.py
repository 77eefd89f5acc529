"""Block-scaled rows packed with their scales, one record per row: the record layout, the bytes
per row, and the packed CPU gather bit for bit against the gather of the two separate arrays
(the golden vectors run through packed tables in test_nvfp4 and test_mxfp8)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import ngram_cupy as nc
from ngram_cupy.formats import BFLOAT16, FLOAT8_E4M3, FORMATS, MXFP8, NVFP4
from ngram_cupy.tables.gather_numba import gather_rows
from ngram_cupy.tables.hot_rows import build_map
from ngram_cupy.tables.packed import packed_rows, record_bytes


@pytest.mark.parametrize("code, head_dim, record", [
    (NVFP4, 160, 96), (MXFP8, 256, 272), (NVFP4, 16, 16), (MXFP8, 32, 48),
    (FLOAT8_E4M3, 160, 160), (BFLOAT16, 160, 320)])
def test_record_bytes(code, head_dim, record):
    assert record_bytes(FORMATS[code], head_dim) == record


def random_rows(rng, code, rows, head_dim):
    """Random codes and scale bytes of a block-scaled format (every scale byte but NaN)."""
    fmt = FORMATS[code]
    codes = rng.integers(0, 256, (rows, fmt.row_width(head_dim)), dtype=np.uint8)
    scales = rng.integers(0, 0xFF if code == MXFP8 else 0x7F, (rows, fmt.scale_width(head_dim)),
                          dtype=np.uint8)
    return codes, scales


@pytest.mark.parametrize("code, head_dim", [(NVFP4, 160), (MXFP8, 256), (NVFP4, 48)])
def test_tables_store_one_record_per_row(code, head_dim):
    """Codes, then scales, then zero padding; ``host_view`` / ``host_scales`` are views."""
    rng = np.random.default_rng(code)
    codes, scales = random_rows(rng, code, 30, head_dim)
    fmt = FORMATS[code]
    weight = codes if code == NVFP4 else codes.view(ml_dtypes.float8_e4m3fn)
    table = nc.EmbeddingTable(weight, dtype=fmt.name, block_scales=scales,
                              scale=0.5 if code == NVFP4 else None)
    records = table.storage.records
    width, record = codes.shape[1], record_bytes(fmt, head_dim)
    assert records.shape == (30, record) and table.storage.nbytes == 30 * record
    np.testing.assert_array_equal(records[:, :width], codes)
    np.testing.assert_array_equal(records[:, width:width + scales.shape[1]], scales)
    assert not records[:, width + scales.shape[1]:].any()
    assert np.shares_memory(table.host_view, records)
    assert np.shares_memory(table.host_scales, records)


@pytest.mark.parametrize("code", [NVFP4, MXFP8])
def test_packed_gather_equals_the_separate_arrays(code):
    """To bf16 (the golden tests run every output through packed tables), serial and threaded,
    a row shard with other shards' ids, a hot tier of records."""
    rng = np.random.default_rng(10 + code)
    head_dim = 64
    fmt = FORMATS[code]
    codes, scales = random_rows(rng, code, 50, head_dim)
    records, rows, row_scales = packed_rows(50, head_dim, fmt)
    rows.view(np.uint8)[...], row_scales[...] = codes, scales
    ids = rng.integers(0, 60, (70, 3))
    hot = np.arange(0, 50, 3)
    scale = np.float32(0.75 if code == NVFP4 else 1.0)
    out_code = BFLOAT16
    for parallel in (False, True):
        shape = (70, 3 * head_dim)
        want = np.zeros(shape, FORMATS[out_code].raw)
        gather_rows(codes, code, 5, scale, ids, want, out_code, parallel=parallel, scales=scales)
        got = np.full(shape, 0xAB, FORMATS[out_code].raw)
        gather_rows(rows.view(np.uint8), code, 5, scale, ids, got, out_code, parallel=parallel,
                    records=records, total_rows=60)
        np.testing.assert_array_equal(got, want, err_msg=f"{fmt.name} -> {out_code}")
        tiered = np.full(shape, 0xAB, FORMATS[out_code].raw)
        counts = np.zeros(2, np.int64)
        gather_rows(rows.view(np.uint8), code, 5, scale, ids, tiered, out_code, parallel=False,
                    hot=(build_map(hot, 0, 50), records[hot]),
                    counts=counts, records=records)
        np.testing.assert_array_equal(tiered, want)
        local = ids - 5
        owned = (local >= 0) & (local < 50)
        assert counts[0] == (owned & np.isin(local, hot)).sum() and counts.sum() == owned.sum()


def test_a_tier_over_packed_rows_keeps_its_records_current():
    rng = np.random.default_rng(3)
    codes, scales = random_rows(rng, NVFP4, 40, 32)
    table = nc.EmbeddingTable.empty(40, 32, "nvfp4", scale=2.0, hot_rows=np.arange(0, 40, 2))
    table.write_rows(0, codes, scales)
    plain = nc.EmbeddingTable(codes, dtype="nvfp4", block_scales=scales, scale=2.0)
    ids = rng.integers(0, 40, (25, 2))
    np.testing.assert_array_equal(table.lookup(ids).view(np.uint16),
                                  plain.lookup(ids).view(np.uint16))
    assert table.counters["hot_rows"] == int((ids % 2 == 0).sum())
