"""Block-scaled rows packed with their scales, one record per row: the record layout, the bytes
per row, and every gather of packed records (the Numba CPU gather, ``gather.cu`` built for the
host, the fused kernel in the simulator) bit for bit against the gather of the two separate
arrays and the plain reference (the golden vectors run through packed tables in test_nvfp4 and
test_mxfp8)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import simulator
from conftest import assert_same, laid_out

import ngram_cupy as nc
from ngram_cupy.codecs.dequant import reference_block_lookup
from ngram_cupy.codecs.records import packed_rows, record_bytes, record_views, whole_records
from ngram_cupy.formats import BFLOAT16, FLOAT8_E4M3, FORMATS, MXFP8, NVFP4, OUTPUT_CODES
from ngram_cupy.ids import fused_cuda, ids_cuda
from ngram_cupy.tables import gather_cupy
from ngram_cupy.tables.gather_numba import gather_rows
from ngram_cupy.tables.hot_rows import build_map
from ngram_cupy.tables.row_ids import NO_BAD_WORD, raise_recorded
from ngram_cupy.tables.storage.tiered import DeviceTier


@pytest.mark.parametrize("code, head_dim, record", [
    (NVFP4, 160, 96), (MXFP8, 256, 272), (NVFP4, 16, 16), (MXFP8, 32, 48),
    (FLOAT8_E4M3, 160, 160), (BFLOAT16, 160, 320)])
def test_record_bytes(code, head_dim, record):
    assert record_bytes(FORMATS[code], head_dim) == record


def block_rows(rng, code, rows, head_dim):
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
    codes, scales = block_rows(rng, code, 30, head_dim)
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
    codes, scales = block_rows(rng, code, 50, head_dim)
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
    codes, scales = block_rows(rng, NVFP4, 40, 32)
    table = nc.EmbeddingTable.empty(40, 32, "nvfp4", scale=2.0, hot_rows=np.arange(0, 40, 2))
    table.write_rows(0, codes, scales)
    plain = nc.EmbeddingTable(codes, dtype="nvfp4", block_scales=scales, scale=2.0)
    ids = rng.integers(0, 40, (25, 2))
    np.testing.assert_array_equal(table.lookup(ids).view(np.uint16),
                                  plain.lookup(ids).view(np.uint16))
    assert table.counters["hot_rows"] == int((ids % 2 == 0).sum())


# ---------------------------------------------------------------- the GPU kernels, on the host

SCALES = {NVFP4: 0.75, MXFP8: 1.0}


@pytest.mark.parametrize("code", [NVFP4, MXFP8])
def test_host_built_cuda_gather_reads_packed_records(host_gather, code):
    """gather.cu over a row shard's records (the views' row strides) equals the two arrays and
    the reference, every output: other shards' ids give zero rows and ids outside the table are
    the bad word's IndexError; one 16-byte load per thread over a record's values."""
    rng = np.random.default_rng(20 + code)
    fmt, head_dim, start, total = FORMATS[code], 64, 5, 60
    codes, scales = block_rows(rng, code, 50, head_dim)
    ids = rng.integers(0, total, (70, 3))
    ids[3, 1] = 0  # another shard's, below this one
    bad_ids = ids.copy()
    bad_ids[40, 2], bad_ids[52, 0] = total, -1
    record = record_bytes(fmt, head_dim)
    for out_code in OUTPUT_CODES:
        out_fmt = FORMATS[out_code]
        want = reference_block_lookup(fmt, codes, scales, SCALES[code], ids, out_fmt.dtype, start)
        for packed in (False, True):
            rows, row_scales = laid_out(codes, scales, fmt, packed)
            out = np.full(want.shape, 0xAB, out_fmt.raw)
            plan = gather_cupy.launch_plan(rows, code, start, SCALES[code], ids, out, out_code,
                                           scales=row_scales)
            strides = (record, record) if packed else (codes.shape[1], scales.shape[1])
            assert (plan.args[7], plan.args[8]) == strides and ", 16, " in plan.name
            host_gather.run(plan)
            assert_same(out, want, f"{fmt.name} -> {out_fmt.name}, packed={packed}")
            bad = np.full(1, NO_BAD_WORD, np.uint64)
            host_gather.run(gather_cupy.launch_plan(rows, code, start, SCALES[code], bad_ids, out,
                                                    out_code, scales=row_scales,
                                                    total_rows=total, bad=bad))
            with pytest.raises(IndexError, match=r"ids\[40, 2\] = 60"):
                raise_recorded(bad_ids, bad, total)


@pytest.mark.parametrize("code", [NVFP4, MXFP8])
def test_host_built_tiered_gather_reads_hot_records(host_gather, code):
    """A hot tier of records over cold records: hot rows from the tier (the cold records hold
    garbage there, so a mixed-up read shows), counted per tier."""
    rng = np.random.default_rng(30 + code)
    fmt, head_dim = FORMATS[code], 64
    codes, scales = block_rows(rng, code, 40, head_dim)
    hot = np.arange(0, 40, 3)
    records, rows, row_scales = packed_rows(40, head_dim, fmt)
    rows.view(np.uint8)[...], row_scales[...] = codes, scales
    hot_records = records[hot]
    records[hot, : codes.shape[1]] = 0x77
    hot_rows, hot_scales = record_views(hot_records, fmt, head_dim, raw=True)
    ids = rng.integers(0, 40, (30, 2))
    counts = np.zeros((gather_cupy.COUNTER_LANES, 2), np.uint64)
    out = np.zeros((30, 2 * head_dim), np.uint16)
    host_gather.run(gather_cupy.launch_plan(
        rows.view(np.uint8), code, 0, SCALES[code], ids, out, BFLOAT16,
        hot=(build_map(hot, 0, 40), hot_rows), counts=counts, scales=row_scales,
        hot_scales=hot_scales))
    assert_same(out, reference_block_lookup(fmt, codes, scales, SCALES[code], ids,
                                            FORMATS[BFLOAT16].dtype))
    assert counts[:, 0].sum() == np.isin(ids, hot).sum()
    with pytest.raises(ValueError, match="one row stride"):  # hot rows laid out otherwise
        gather_cupy.launch_plan(rows.view(np.uint8), code, 0, 1.0, ids, out, BFLOAT16,
                                hot=(build_map(hot, 0, 40), codes[hot]), counts=counts,
                                scales=row_scales, hot_scales=hot_scales)


def test_gather_plans_refuse_rows_that_are_not_contiguous():
    ids, out = np.zeros((2, 1), np.int64), np.zeros((2, 16), np.uint16)
    with pytest.raises(ValueError, match=r"table must have contiguous rows, got strides \(1, 8\)"):
        gather_cupy.launch_plan(np.zeros((4, 8), np.uint8).T, FLOAT8_E4M3, 0, 1.0, ids, out,
                                BFLOAT16)
    records, rows, scales = packed_rows(4, 32, FORMATS[NVFP4])
    with pytest.raises(ValueError, match="scales must have contiguous rows"):
        gather_cupy.launch_plan(rows, NVFP4, 0, 1.0, ids, out[:, :32], BFLOAT16,
                                scales=records[:, ::2][:, :2])


def test_whole_records_of_views_and_of_two_arrays():
    fmt = FORMATS[NVFP4]
    records, rows, scales = packed_rows(6, 160, fmt)
    whole, whole_scales, column = whole_records(rows, scales)
    assert whole.flags.c_contiguous and whole.shape == (6, 96) and column == 80
    assert whole_scales is whole and whole.ctypes.data == records.ctypes.data
    codes, apart = np.zeros((6, 80), np.uint8), np.zeros((6, 10), np.uint8)
    assert whole_records(codes, apart) == (codes, apart, 0)
    with pytest.raises(ValueError, match="views into one record per row"):
        whole_records(rows, records[:, 1:11])


@pytest.mark.parametrize("code", [NVFP4, MXFP8])
def test_simulated_fused_kernel_reads_packed_records(simulate, code):
    """The fused kernel over a shard's records and over the two arrays, hashed ids of a layout
    whose rows run past the table's (total_rows smaller): equal rows (zero outside the shard)
    and the same IndexError, naming the first token and head outside the table."""
    rng = np.random.default_rng(40 + code)
    fmt = FORMATS[code]
    layout = nc.layer_layout(nc.NGramConfig(50, 3, 1, 7, 0, embedding_dim=64), 0)
    head_dim = layout.head_dim
    total, start = layout.padded_rows - 3, 2
    codes, scales = block_rows(rng, code, total - start - 1, head_dim)  # the last row: others'
    batch = simulator.wild_batch(rng, layout, 12, 3)
    ids = nc.compute_ngram_ids(layout, *batch)
    position = np.flatnonzero(ids.reshape(-1) >= total)
    assert position.size and (ids < start).any()  # ids in every range
    heads = layout.num_heads
    for out_code in OUTPUT_CODES:
        out_fmt = FORMATS[out_code]
        want = reference_block_lookup(fmt, codes, scales, SCALES[code], ids, out_fmt.dtype,
                                      start)
        for packed in (False, True):
            rows, row_scales = laid_out(codes, scales, fmt, packed)
            out = np.full(want.shape, 0xAB, out_fmt.raw)
            bad = np.full(1, NO_BAD_WORD, np.uint64)
            fused_cuda.launch_fused(layout, *batch, ids_cuda.layout_params(layout), code=code,
                                    row_start=start, scale=SCALES[code], write_ids=False,
                                    ids_out=np.zeros((1, 1), np.int64), out=out,
                                    out_code=out_code, block=4, total_rows=total, bad=bad,
                                    **fused_cuda.kernel_tables(rows, 1, row_scales))
            assert_same(out, want, f"{fmt.name} -> {out_fmt.name}, packed={packed}")
            with pytest.raises(IndexError, match=f"token {position[0] // heads}, head "
                                                 f"{position[0] % heads} "):
                fused_cuda.raise_hashed(bad, heads, total)


def test_a_gpu_tier_over_records_uploads_hot_records(monkeypatch):
    """Over packed cold rows the GPU tier is one upload of hot records (no scale array of its
    own), its rows and scales views with the record's stride, read whole by the fused kernel."""
    from contextlib import nullcontext
    from types import SimpleNamespace

    from ngram_cupy.tables.storage import tiered
    from ngram_cupy.tables.storage.cpu import CpuStorage

    class Stream:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def synchronize(self):
            pass

    uploads = []
    monkeypatch.setattr(tiered, "cupy_module", lambda: SimpleNamespace(
        asarray=lambda array: uploads.append(array.shape) or np.array(array)))
    monkeypatch.setattr(tiered, "cuda_stream", Stream)
    fmt = FORMATS[NVFP4]
    codes, scales = block_rows(np.random.default_rng(5), NVFP4, 40, 160)
    records, rows, row_scales = packed_rows(40, 160, fmt)
    rows[...], row_scales[...] = codes, scales
    cold = CpuStorage(rows, fmt, row_scales, records)
    cold.device_view = SimpleNamespace(device=nullcontext())  # as if the GPU read it
    hot = np.arange(0, 40, 4)
    tier = tiered.TieredStorage(cold, hot).device_tier
    assert uploads == [(1,), (1,), (10, 96), (gather_cupy.COUNTER_LANES, 2)]
    assert tier.rows.strides[0] == tier.scales.strides[0] == 96
    np.testing.assert_array_equal(tier.rows, codes[hot])
    np.testing.assert_array_equal(tier.scales, scales[hot])
    tables = fused_cuda.kernel_tables(rows, 1, row_scales, tier)
    assert tables["scale_column"] == 80 and tables["table_words"].shape == (40, 12)
    assert tables["hot"][1].shape == (10, 12) and tables["hot_scales"].shape == (10, 96)


def test_simulated_fused_kernel_reads_a_tier_of_hot_records(simulate):
    rng = np.random.default_rng(50)
    fmt = FORMATS[NVFP4]
    layout = nc.layer_layout(nc.NGramConfig(50, 2, 2, 7, 0, embedding_dim=64), 0)
    rows = layout.padded_rows
    codes, scales = block_rows(rng, NVFP4, rows, layout.head_dim)
    hot = np.arange(1, rows, 2)
    batch = simulator.wild_batch(rng, layout, 9, 2)
    ids = nc.compute_ngram_ids(layout, *batch)
    records, cold, cold_scales = packed_rows(rows, layout.head_dim, fmt)
    cold.view(np.uint8)[...], cold_scales[...] = codes, scales
    hot_rows, hot_scales = record_views(records[hot], fmt, layout.head_dim, raw=True)
    records[hot, :codes.shape[1]] = 0x77  # stale cold copies of hot rows: a mixed-up read shows
    counts = np.zeros((gather_cupy.COUNTER_LANES, 2), np.uint64)
    tier = DeviceTier(build_map(hot, 0, rows), hot_rows, counts, hot_scales)
    out = np.zeros((9, layout.num_heads * layout.head_dim), np.uint16)
    fused_cuda.launch_fused(layout, *batch, ids_cuda.layout_params(layout), code=NVFP4,
                            row_start=0, scale=0.5, write_ids=False,
                            ids_out=np.zeros((1, 1), np.int64), out=out, out_code=BFLOAT16,
                            block=4, **fused_cuda.kernel_tables(cold.view(np.uint8), 1,
                                                                cold_scales, tier))
    assert_same(out, reference_block_lookup(fmt, codes, scales, 0.5, ids,
                                            FORMATS[BFLOAT16].dtype))
    assert counts.sum(axis=0).tolist() == [np.isin(ids, hot).sum(), (~np.isin(ids, hot)).sum()]


# ---------------------------------------------------------------- on a GPU

@pytest.mark.gpu
@pytest.mark.parametrize("code", [NVFP4, MXFP8])
@pytest.mark.parametrize("placement, hot", [("gpu", False), ("pinned", False), ("pinned", True)])
def test_gpu_storages_hold_and_read_records(code, placement, hot):
    """GPU memory, pinned memory read over UVA and a GPU hot tier hold one record per row (their
    views step a record a row); lookups (plain, deduplicated, fused) equal the CPU gather of the
    two arrays bit for bit: other shards' ids zero rows, ids outside the table an IndexError."""
    import cupy

    rng = np.random.default_rng(60 + code)
    fmt, head_dim, start = FORMATS[code], 64, 2
    layout = nc.layer_layout(nc.NGramConfig(50, 3, 1, 7, 0, embedding_dim=2 * head_dim), 0)
    total = layout.padded_rows
    codes, scales = block_rows(rng, code, total - start, head_dim)
    weight = codes if code == NVFP4 else codes.view(ml_dtypes.float8_e4m3fn)
    kwargs = dict(dtype=fmt.name, row_start=start, total_rows=total,
                  scale=SCALES[code] if code == NVFP4 else None)
    table = nc.EmbeddingTable(weight, block_scales=scales, placement=placement,
                              hot_rows=np.arange(start, total, 3) if hot else None, **kwargs)
    storage, record = table.storage.cold, record_bytes(fmt, head_dim)
    assert storage.packed and storage.nbytes == (total - start) * record
    assert storage.device_view.strides[0] == storage.device_scales.strides[0] == record
    ids = rng.integers(0, total, (40, 2))
    want = np.zeros((40, 2 * head_dim), np.uint16)
    gather_rows(codes, code, start, np.float32(SCALES[code]), ids, want, BFLOAT16, scales=scales)
    for dedup in (False, True):
        table.dedup = dedup
        got = cupy.asnumpy(table.lookup(cupy.asarray(ids)))
        np.testing.assert_array_equal(got.view(np.uint16), want, err_msg=f"dedup={dedup}")
    bad = ids.copy()
    bad[7, 1] = total
    with pytest.raises(IndexError, match=r"ids\[7, 1\]"):
        table.lookup(cupy.asarray(bad))
    batch = simulator.wild_batch(rng, layout, 16, 2)
    fused = nc.NGramEmbedding(layout, table, fused=True)(*(cupy.asarray(a) for a in batch))
    hashed = nc.compute_ngram_ids(layout, *batch)
    want = np.zeros((16, 2 * head_dim), np.uint16)
    gather_rows(codes, code, start, np.float32(SCALES[code]), hashed, want, BFLOAT16, scales=scales)
    np.testing.assert_array_equal(cupy.asnumpy(fused).view(np.uint16), want)
