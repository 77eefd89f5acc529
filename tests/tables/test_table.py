"""EmbeddingTable on the CPU: every storage dtype against plain NumPy ``table[ids]``, sharding,
out=, checkpoint-style filling, torch interop and clear errors."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
from conftest import HAS_GPU
from hypothesis import given, settings
from hypothesis import strategies as st

import ngram_cupy as nc
from ngram_cupy.codecs import dequant
from ngram_cupy.codecs.dequant import reference_lookup
from ngram_cupy.tables.gather_numba import gather_rows

STORAGE = [np.float32, np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn]
OUTPUTS = [np.float32, np.float16, ml_dtypes.bfloat16]


def every_bit_pattern(dtype, head_dim: int = 8) -> np.ndarray:
    """A table holding every value of the format (NaNs, infinities, subnormals, signed zeros)."""
    fmt = dequant.storage_format(dtype)
    count = min(1 << (8 * fmt.itemsize), 1 << 16)
    bits = np.arange(count, dtype=np.uint64).astype(fmt.raw)
    if fmt.itemsize == 4:  # float32: edge values plus random patterns
        rng = np.random.default_rng(0)
        bits = rng.integers(0, 1 << 32, count, dtype=np.uint64).astype(np.uint32)
        bits[:8] = [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00001, 1, 0x00800000, 0x477FF000]
    bits = np.concatenate([bits, np.zeros(-bits.size % head_dim, bits.dtype)])
    return bits.view(fmt.dtype).reshape(-1, head_dim)


def random_table(rng, rows: int, head_dim: int, dtype) -> np.ndarray:
    """Normal values (fp8: scaled into its range) stored as ``dtype``."""
    values = rng.standard_normal((rows, head_dim)).astype(np.float32)
    return (values * 8).astype(dtype)


def assert_same_array(actual, expected):
    """Equal bits (signed zeros included); NaN matches NaN, payloads aside."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    nan = np.isnan(expected.astype(np.float32))
    np.testing.assert_array_equal(np.isnan(actual.astype(np.float32)), nan)
    bits = f"u{actual.dtype.itemsize}"
    np.testing.assert_array_equal(actual.view(bits)[~nan], expected.view(bits)[~nan])


@pytest.mark.parametrize("out_dtype", OUTPUTS, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("dtype", STORAGE, ids=lambda d: np.dtype(d).name)
def test_every_value_of_every_format(dtype, out_dtype):
    weight = every_bit_pattern(dtype)
    rng = np.random.default_rng(1)
    ids = rng.integers(0, weight.shape[0] + 3, (257, 5))  # past the rows: another shard's
    ids[0] = np.arange(5)
    for scale in (None, 0.5, 3.0e-3, -2.0, 70000.0):
        if scale == -2.0 and dtype == ml_dtypes.float8_e4m3fn:  # refused as the loaders do
            with pytest.raises(ValueError, match="scale must be a finite positive number"):
                nc.EmbeddingTable(weight, scale=scale)
            continue
        table = nc.EmbeddingTable(weight, scale=scale, total_rows=weight.shape[0] + 3)
        result = table.lookup(ids, out_dtype=out_dtype)
        expected = reference_lookup(weight, ids, 1.0 if scale is None else scale, out_dtype)
        assert_same_array(result, expected)


# Scales whose fp8 products round to bf16 subnormals, overflow to infinity, or are NaN.
FP8_SCALES = (1.0, 0.5, -0.5, 0.0, -0.0, 3.0e-3, 2.0**-130, 2.0**-140, 2.0**-149, 7.123, -300.0,
              1.0e36, 3.0e38, np.inf, -np.inf, np.nan, 1.0000001, 2.0**120)


@pytest.mark.parametrize("head_dim", [160, 20])
def test_fp8_to_bf16_gather_is_exact_for_every_byte_and_scale(head_dim):
    """The vectorised fp8 -> bf16 conversion: every byte, edge and random scales, serial and
    parallel, against the reference; NaNs come out as the canonical 0x7FC0. The kernel
    multiplies by the scale it is given (tables round it first: test_scale_rounding), so the
    reference is the single rounding of the float32 product."""
    weight = every_bit_pattern(ml_dtypes.float8_e4m3fn, head_dim)
    ids = np.arange(weight.shape[0])[:, None].repeat(3, axis=0).reshape(-1, 1)
    ids = np.concatenate([ids, ids[::-1]], axis=1)
    random_bits = np.random.default_rng(4).integers(0, 1 << 32, 40, dtype=np.uint64)
    scales = [np.float32(s) for s in FP8_SCALES] + list(random_bits.astype(np.uint32).view(
        np.float32))
    for scale in scales:
        expected = reference_lookup(weight, ids, scale, ml_dtypes.bfloat16,
                                    "float32").view(np.uint16)
        nan = np.isnan(expected.view(ml_dtypes.bfloat16).astype(np.float32))
        expected = np.where(nan, np.uint16(0x7FC0), expected)
        for parallel in (False, True):
            out = np.empty(expected.shape, np.uint16)
            gather_rows(weight.view(np.uint8), dequant.FLOAT8_E4M3, 0, scale, ids, out,
                        dequant.BFLOAT16, parallel=parallel)
            np.testing.assert_array_equal(out, expected, err_msg=f"scale {scale!r}")


def test_int32_ids_reach_the_cpu_gather_as_int64():
    """The CPU gather widens int32 ids first: one compiled kernel serves both id types (each
    kernel compiled for both took another 1-5 s)."""
    from ngram_cupy.tables import gather_numba

    weight = random_table(np.random.default_rng(8), 9, 4, ml_dtypes.float8_e4m3fn)
    ids = np.array([[8, 0, 3], [3, 12, -1]])
    expected = reference_lookup(weight, ids, 0.5, ml_dtypes.bfloat16).view(np.uint16)
    for dtype in (np.int32, np.int64):
        out = np.empty(expected.shape, np.uint16)
        gather_rows(weight.view(np.uint8), dequant.FLOAT8_E4M3, 0, np.float32(0.5),
                    ids.astype(dtype), out, dequant.BFLOAT16, parallel=False)
        np.testing.assert_array_equal(out, expected)
    kernel = gather_numba.gather_kernel(dequant.FLOAT8_E4M3, dequant.BFLOAT16, False)
    assert {signature[4].dtype.name for signature in kernel.signatures} == {"int64"}


def test_every_row_of_every_pattern_is_read():
    """All rows in order: the whole table comes back, bit for bit (NaNs canonical)."""
    for dtype in STORAGE:
        weight = every_bit_pattern(dtype)
        ids = np.arange(weight.shape[0]).reshape(-1, 1)
        out_dtype = np.float32
        result = nc.EmbeddingTable(weight).lookup(ids, out_dtype=out_dtype)
        expected = weight.astype(np.float32).reshape(result.shape)
        nan = np.isnan(expected)
        np.testing.assert_array_equal(result.view(np.uint32)[~nan], expected.view(np.uint32)[~nan])
        assert np.all(result.view(np.uint32)[nan] == 0x7FC00000)


def test_default_output_dtypes():
    rng = np.random.default_rng(2)
    for dtype, expected in [(np.float32, np.float32), (np.float16, np.float16),
                            (ml_dtypes.bfloat16, ml_dtypes.bfloat16),
                            (ml_dtypes.float8_e4m3fn, ml_dtypes.bfloat16)]:
        table = nc.EmbeddingTable(random_table(rng, 10, 4, dtype))
        assert table.lookup(np.zeros((2, 3), np.int64)).dtype == np.dtype(expected)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_sharded_lookups_sum_to_the_whole(data):
    """Row shards: each rank zeros rows it does not own; the sum over ranks is the full lookup."""
    rows = data.draw(st.integers(1, 40))
    head_dim = data.draw(st.integers(1, 9))
    dtype = data.draw(st.sampled_from(STORAGE))
    weight = random_table(np.random.default_rng(rows), rows, head_dim, dtype)
    cuts = sorted(data.draw(st.lists(st.integers(0, rows), max_size=3)))
    bounds = [0, *cuts, rows]
    ids = np.array(data.draw(st.lists(st.lists(st.integers(0, rows - 1), min_size=3,
                                               max_size=3), max_size=12)), dtype=np.int64)
    # int32 ids (the Numba gather's only check of them against a reference) but for float32,
    # whose kernels compile slowest (5-10 s): the id loads are the same for every format.
    id_types = [np.int64] if dtype is np.float32 else [np.int32, np.int64]
    ids = ids.reshape(-1, 3).astype(data.draw(st.sampled_from(id_types)))
    total = np.zeros((ids.shape[0], 3 * head_dim), np.float32)
    for start, stop in zip(bounds[:-1], bounds[1:], strict=True):
        shard = nc.EmbeddingTable(weight[start:stop], scale=0.25, row_start=start,
                                  total_rows=rows)
        part = shard.lookup(ids, out_dtype=np.float32)
        owned = np.repeat((ids >= start) & (ids < stop), head_dim, axis=1)
        assert not part[~owned].any()
        total += part
    np.testing.assert_array_equal(total, reference_lookup(weight, ids, 0.25, np.float32))


def test_serial_and_parallel_gathers_agree():
    rng = np.random.default_rng(3)
    weight = random_table(rng, 500, 16, ml_dtypes.float8_e4m3fn)
    ids = rng.integers(-10, 510, (300, 16))
    outs = []
    for parallel in (False, True):
        out = np.empty((300, 256), np.uint16)
        gather_rows(weight.view(np.uint8), dequant.FLOAT8_E4M3, 0, np.float32(0.5), ids, out,
                    dequant.BFLOAT16, parallel=parallel)
        outs.append(out)
    np.testing.assert_array_equal(*outs)
    np.testing.assert_array_equal(outs[0].view(ml_dtypes.bfloat16),
                                  reference_lookup(weight, ids, 0.5, ml_dtypes.bfloat16))


def test_out_is_written_and_returned():
    rng = np.random.default_rng(4)
    weight = random_table(rng, 30, 6, ml_dtypes.float8_e4m3fn)
    table = nc.EmbeddingTable(weight, scale=2.0)
    ids = rng.integers(0, 30, (5, 2))
    out = np.full((5, 12), np.nan, dtype=ml_dtypes.bfloat16)
    assert table.lookup(ids, out=out) is out
    assert_same_array(out, reference_lookup(weight, ids, 2.0, ml_dtypes.bfloat16))
    raw = np.zeros((5, 12), np.uint16)  # raw bits are accepted as the default output type
    table.lookup(ids, out=raw)
    np.testing.assert_array_equal(raw, out.view(np.uint16))
    wide = np.zeros((5, 12), np.float32)  # out's dtype picks the output type
    table.lookup(ids, out=wide)
    np.testing.assert_array_equal(wide, reference_lookup(weight, ids, 2.0, np.float32))


def test_an_out_sharing_the_tables_memory_is_refused():
    weight = np.ones((8, 3), np.float16)
    table = nc.EmbeddingTable(weight)
    ids = np.array([[1], [2]])
    rows = table.host_view
    for out in (rows[2:4], rows.reshape(-1)[3:9].reshape(2, 3), torch.from_numpy(rows)[:2]):
        for call in (table.lookup, table.prefetch):
            with pytest.raises(ValueError, match="out shares memory with the table's rows"):
                call(ids, out=out)
    assert (table.host_view == 1).all()
    assert table.lookup(ids, out=np.zeros((2, 3), np.float16)).tolist() == [[1.0] * 3] * 2


def test_ids_of_any_leading_shape():
    """``[B, S, H]`` ids (compute_ngram_ids of ``[B, S]`` tokens) give ``[B, S, H * head_dim]``."""
    table = nc.EmbeddingTable(np.arange(24, dtype=np.float16).reshape(8, 3))
    ids = np.random.default_rng(0).integers(0, 8, (2, 3, 4))
    flat = table.lookup(ids.reshape(6, 4))
    rows = table.lookup(ids)
    assert rows.shape == (2, 3, 12) and rows.tobytes() == flat.tobytes()
    out = np.zeros((2, 3, 12), np.float16)
    assert table.lookup(ids, out=out) is out and out.tobytes() == flat.tobytes()
    table.prefetch(ids[:, :, :2])
    assert table.lookup(ids[:, :, :2]).tobytes() == flat[:, :6].tobytes()
    tensor = table.lookup(torch.from_numpy(ids))
    assert tensor.shape == (2, 3, 12) and tensor.numpy().tobytes() == flat.tobytes()
    with pytest.raises(ValueError, match="out must have shape"):
        table.lookup(ids, out=np.zeros((2, 3, 11), np.float16))


def test_empty_batches_and_heads():
    table = nc.EmbeddingTable(np.ones((4, 3), np.float16))  # float32: a 10 s compile per id type
    assert table.lookup(np.zeros((0, 2), np.int64)).shape == (0, 6)
    assert table.lookup(np.zeros((3, 0), np.int32)).shape == (3, 0)


def test_the_sign_of_a_zero_scale_is_kept():
    """-0.0 and 0.0 are equal floats but give zeros of other signs: neither may reuse the
    other's cached conversion (float8 tables refuse both, as their loaders do)."""
    for dtype in (np.float16, np.float32):
        weight = random_table(np.random.default_rng(7), 6, 4, dtype)
        ids = np.arange(6).reshape(3, 2)
        for scale in (0.0, -0.0, 0.0):
            result = nc.EmbeddingTable(weight, scale=scale).lookup(ids, out_dtype=np.float32)
            expected = reference_lookup(weight, ids, scale, np.float32)
            np.testing.assert_array_equal(result.view(np.uint32), expected.view(np.uint32))


def test_cached_cpu_kernels_are_keyed_by_the_shared_decoding():
    """Numba's disk cache watches only gather_numba.py: every cached kernel that inlines
    dequant.py must carry its digest in its closure (its cache key)."""
    from ngram_cupy.tables import gather_numba

    kernels = [gather_numba._convert_all_kernel(),
               gather_numba.gather_kernel(dequant.FLOAT8_E4M3, dequant.BFLOAT16, False)]
    for kernel in kernels:
        cells = [cell.cell_contents for cell in kernel.py_func.__closure__]
        assert gather_numba.DEQUANT_DIGEST in cells, kernel


def test_scale_from_a_bf16_array_is_exact():
    scale = np.array([0.0078125 * 3], dtype=ml_dtypes.bfloat16)  # checkpoints: a bf16 tensor
    table = nc.EmbeddingTable(np.ones((2, 2), ml_dtypes.float8_e4m3fn), scale=scale)
    assert table.scale == np.float32(scale[0])
    table = nc.EmbeddingTable(np.ones((2, 2), np.float32), scale=torch.tensor(0.5).bfloat16())
    assert table.scale == np.float32(0.5)


def test_empty_then_write_rows_like_a_checkpoint_loader():
    rng = np.random.default_rng(5)
    weight = random_table(rng, 50, 4, ml_dtypes.float8_e4m3fn)
    for placement in ("cpu", "host"):
        table = nc.EmbeddingTable.empty(30, 4, "float8_e4m3fn", placement=placement, scale=0.5,
                                        row_start=10, total_rows=50)
        for start in range(10, 40, 7):  # blocks that do not align with anything
            stop = min(start + 7, 40)
            table.write_rows(start, weight[start:stop])
        np.testing.assert_array_equal(table.host_view.view(np.uint8), weight[10:40].view(np.uint8))
        ids = rng.integers(0, 50, (9, 3))
        expected = reference_lookup(weight, ids, 0.5, ml_dtypes.bfloat16)
        expected[np.repeat((ids < 10) | (ids >= 40), 4, axis=1)] = 0
        assert_same_array(table.lookup(ids), expected)
        assert table.nbytes == 30 * 4 and table.total_rows == 50 and table.row_start == 10


def test_write_rows_errors_name_the_problem():
    table = nc.EmbeddingTable.empty(10, 4, np.float16, row_start=5, total_rows=20)
    block = np.zeros((3, 4), np.float16)
    with pytest.raises(ValueError, match=r"outside this table's rows \[5, 15\)"):
        table.write_rows(13, block)
    with pytest.raises(ValueError, match="outside"):
        table.write_rows(4, block)
    with pytest.raises(ValueError, match="head_dim=4"):
        table.write_rows(5, np.zeros((3, 5), np.float16))
    with pytest.raises(TypeError, match="rows must have dtype float16"):
        table.write_rows(5, np.zeros((3, 4), np.float32))
    with pytest.raises(TypeError, match="start must be an integer"):
        table.write_rows(5.0, block)


def test_cpu_placement_uses_the_callers_array_and_host_falls_back():
    weight = np.arange(12, dtype=np.float32).reshape(4, 3)
    assert np.shares_memory(nc.EmbeddingTable(weight).host_view, weight)
    if not HAS_GPU:
        host = nc.EmbeddingTable(weight, placement="host")
        assert not host.pinned and not np.shares_memory(host.host_view, weight)
        np.testing.assert_array_equal(host.lookup(np.array([[3, 1]])), [[9, 10, 11, 3, 4, 5]])
        with pytest.raises(ValueError, match="placement='gpu' needs CuPy and a CUDA device"):
            nc.EmbeddingTable(weight, placement="gpu")


def test_torch_tensors_in_and_zero_copy_out():
    rng = np.random.default_rng(6)
    weight = random_table(rng, 20, 8, ml_dtypes.bfloat16)
    table = nc.EmbeddingTable(torch.from_numpy(weight.view(np.int16)).view(torch.bfloat16))
    assert table.dtype == np.dtype(ml_dtypes.bfloat16)
    ids = torch.randint(0, 20, (4, 2))
    result = table.lookup(ids)  # torch in, torch out (bfloat16 typed)
    assert isinstance(result, torch.Tensor) and result.dtype == torch.bfloat16
    expected = reference_lookup(weight, ids.numpy(), 1.0, ml_dtypes.bfloat16)
    np.testing.assert_array_equal(result.view(torch.int16).numpy(), expected.view(np.int16))
    assert_same_array(table.lookup(ids.numpy()), expected)  # NumPy in, NumPy out
    out = torch.empty(4, 16, dtype=torch.bfloat16)
    assert table.lookup(ids, out=out) is out  # torch bf16 out written in place
    assert torch.equal(out, result)
    fp8 = torch.from_numpy(random_table(rng, 20, 8, ml_dtypes.float8_e4m3fn).view(np.uint8))
    table = nc.EmbeddingTable(fp8.view(torch.float8_e4m3fn), scale=torch.tensor(0.25))
    floats = table.lookup(ids.int().numpy(), out_dtype=np.float32)
    shared = torch.from_dlpack(floats)
    assert shared.data_ptr() == floats.ctypes.data  # NumPy result to torch without a copy


def test_raw_bits_need_a_dtype():
    bits = np.zeros((3, 2), np.uint8)
    table = nc.EmbeddingTable(bits, dtype="float8_e4m3fn")
    assert table.format.code == dequant.FLOAT8_E4M3
    with pytest.raises(TypeError, match="dtype must be one of"):
        nc.EmbeddingTable(bits)
    with pytest.raises(TypeError, match="cannot hold bfloat16"):
        nc.EmbeddingTable(np.zeros((3, 2), np.float16), dtype="bfloat16")


@pytest.mark.parametrize("call, error, match", [
    (lambda t: t.lookup(np.zeros((2,), np.int64)), ValueError, "ids must be 2-D"),
    (lambda t: t.lookup(np.zeros((2, 1), np.float32)), TypeError, "ids must be int32 or int64"),
    (lambda t: t.lookup(np.zeros((2, 1), np.int64), out=np.zeros((2, 3), np.float32)),
     ValueError, r"out must have shape \(2, 4\)"),
    (lambda t: t.lookup(np.zeros((2, 1), np.int64), out=np.zeros((2, 4), np.float64)),
     TypeError, "out must be float32, float16 or bfloat16"),
    (lambda t: t.lookup(np.zeros((2, 1), np.int64), out=np.zeros((2, 4), np.float16),
                        out_dtype=np.float32), TypeError, "out must have dtype float32"),
    (lambda t: t.lookup(np.zeros((2, 1), np.int64), out=np.zeros((2, 8), np.float32)[:, ::2]),
     ValueError, "out must be C-contiguous"),
    (lambda t: t.lookup(np.zeros((2, 1), np.int64), out_dtype="float8_e4m3fn"), TypeError,
     "out_dtype must be float32, float16 or bfloat16"),
    (lambda t: t.lookup([[0]], out_dtype="int8"), TypeError, "out_dtype must be float32, f"),
])
def test_lookup_errors_name_the_argument(call, error, match):
    table = nc.EmbeddingTable(np.zeros((3, 4), np.float32))
    with pytest.raises(error, match=match):
        call(table)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(weight=np.zeros(3, np.float32)), ValueError, "weight must be 2-D"),
    (dict(weight=np.zeros((3, 2), np.float32), placement="disk"), ValueError, "placement"),
    (dict(weight=np.zeros((3, 2), np.float32), row_start=2, total_rows=4), ValueError,
     r"rows \[2, 5\) must lie within \[0, total_rows=4\)"),
    (dict(weight=np.zeros((3, 2), np.float32), row_start=-1, total_rows=4), ValueError,
     "must lie within"),
    (dict(weight=np.zeros((3, 2), np.float32), scale=np.ones(2)), ValueError,
     "scale must be a single value"),
    (dict(weight=np.zeros((3, 2), np.float32), scale=float("nan")), ValueError,
     "scale must be finite"),
    (dict(weight=np.zeros((3, 2), np.float32), scale="x"), TypeError, "scale must be a number"),
    (dict(weight=np.zeros((3, 2), np.int64)), TypeError, "dtype must be one of"),
    (dict(weight=np.zeros((3, 2), np.float32), row_start=1.5, total_rows=5), TypeError,
     "row_start must be an integer"),
    (dict(weight=np.zeros((3, 2), np.float32), total_rows=3.0), TypeError,
     "total_rows must be an integer"),
])
def test_construction_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        nc.EmbeddingTable(**kwargs)


def test_a_stream_with_host_ids_is_refused():
    table = nc.EmbeddingTable(np.zeros((3, 4), np.float32))
    with pytest.raises(ValueError, match="stream is only for GPU arrays"):
        table.lookup(np.zeros((2, 1), np.int64), stream=object())


def test_context_manager_and_repr():
    with nc.EmbeddingTable(np.zeros((3, 4), ml_dtypes.float8_e4m3fn), scale=0.5,
                           row_start=2, total_rows=9) as table:
        text = repr(table)
    assert "rows=[2, 5) of 9" in text and "float8_e4m3fn" in text and "scale=0.5" in text


def test_silent_wrong_out_a_python_list_is_a_type_error_for_tables_and_layers():
    table = nc.EmbeddingTable(np.ones((10, 2), np.float32))
    ids = np.zeros((3, 2), dtype=np.int64)
    for call in (table.lookup, table.prefetch):
        with pytest.raises(TypeError, match="out must be an array"):
            call(ids, out=[[0.0] * 4] * 3)
    layout = nc.layer_layout(nc.NGramConfig(50, 3, 1, 3, 0, embedding_dim=4), 0)
    layer = nc.NGramEmbedding(layout, nc.EmbeddingTable(np.ones((layout.padded_rows, 2),
                                                                np.float32)))
    batch = (np.array([1, 2, 3]), np.array([0, 3]), np.zeros((1, 2), np.int64))
    with pytest.raises(TypeError, match="out must be an array"):
        layer(*batch, out=[])
    with pytest.raises(TypeError, match="ids_out must be an array"):
        layer(*batch, ids_out=[])


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.float8_e4m3fn])
@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), float("inf")])
def test_silent_wrong_setting_a_scale_takes_the_constructors_check(dtype, scale):
    """``table.scale = 0.0`` (negative, NaN) on a float8 table would serve zero (flipped, NaN)
    rows: the setter refuses what the constructor refuses and keeps the table's scale."""
    weight = np.arange(32, dtype=np.float32).reshape(8, 4).astype(dtype)
    table = nc.EmbeddingTable(weight, scale=2.0)
    try:
        nc.EmbeddingTable(weight, scale=scale)
    except ValueError:
        with pytest.raises(ValueError, match="scale must be"):
            table.scale = scale
        assert table.scale == np.float32(2.0)
    else:  # float tables take any finite scale (a zero keeps its sign)
        table.scale = scale
        assert table.scale == np.float32(scale)
    assert dtype == np.float32 or table.scale == np.float32(2.0)
    table.scale = 0.5
    assert table.lookup(np.array([[3]]), out_dtype=np.float32)[0, 0] == 6.0
