"""The hot-row tier: each id read from the hot rows when hot, from the table otherwise, with the
untiered table's bytes for every id (hot, cold, out of range, row-sharded), and exact counts."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from ngram_cupy import formats, gather_cupy
from ngram_cupy.dequant import reference_lookup
from ngram_cupy.gather_numba import gather_rows
from ngram_cupy.hot_rows import build_map, check_hot_rows

PAIRS = [(np.float32, np.float32), (np.float16, np.float16), (ml_dtypes.bfloat16, np.float32),
         (ml_dtypes.float8_e4m3fn, ml_dtypes.bfloat16), (ml_dtypes.float8_e4m3fn, np.float16)]


def random_bits(rng, rows: int, head_dim: int, dtype) -> np.ndarray:
    """Random bit patterns of ``dtype`` (NaNs, infinities and subnormals included)."""
    fmt = formats.storage_format(dtype)
    bits = rng.integers(0, 1 << (8 * fmt.itemsize), (rows, head_dim), dtype=np.uint64)
    return bits.astype(fmt.raw).view(fmt.dtype)


def adversarial_ids(rng, hot, row_start, num_rows, shape):
    """Hot rows, cold rows, the first and last rows, ids just outside, negative ids."""
    stop = row_start + num_rows
    pool = np.concatenate([hot, rng.integers(row_start, stop, hot.size + 8),
                           [row_start, stop - 1, row_start - 1, stop, -1, -(1 << 40), 1 << 40]])
    return rng.choice(pool, shape).astype(np.int64)


def tiered_gather(weight, hot_ids, hot_weight, row_start, ids, out_dtype, parallel, scale=0.5):
    """``(out, counts)`` of the tiered CPU gather."""
    fmt = formats.storage_format(weight.dtype)
    out_format = formats.output_format(out_dtype)
    num_rows, head_dim = weight.shape
    hot_map = build_map(check_hot_rows(hot_ids, row_start, num_rows), row_start, num_rows)
    out = np.full((ids.shape[0], ids.shape[1] * head_dim), 0xAB, out_format.raw)
    counts = np.zeros(2, np.int64)
    gather_rows(weight.view(fmt.raw), fmt.code, row_start, np.float32(scale), ids, out,
                out_format.code, parallel=parallel,
                hot=(hot_map, hot_weight.view(fmt.raw)), counts=counts)
    return out.view(out_format.dtype), counts


def expected_counts(ids, hot, row_start, num_rows):
    """Rows read from each tier: ids inside the table, hot or not."""
    inside = (ids >= row_start) & (ids < row_start + num_rows)
    is_hot = np.isin(ids, hot)
    return [int((inside & is_hot).sum()), int((inside & ~is_hot).sum())]


# Every format pair serially; threads (a slow compile) for the released pair only.
CASES = [(*pair, False) for pair in PAIRS] + [(ml_dtypes.float8_e4m3fn, ml_dtypes.bfloat16, True)]


@pytest.mark.parametrize("dtype, out_dtype, parallel", CASES, ids=str)
def test_hot_rows_come_from_the_hot_tier(dtype, out_dtype, parallel):
    rng = np.random.default_rng(1)
    num_rows, head_dim, row_start = 333, 8, 1000  # a shard: global rows [1000, 1333)
    weight = random_bits(rng, num_rows, head_dim, dtype)
    hot = np.unique(np.concatenate([rng.integers(row_start, row_start + num_rows, 60),
                                    [row_start + num_rows - 1]]))
    marked = random_bits(rng, hot.size, head_dim, dtype)  # unlike the table's: proves the source
    ids = adversarial_ids(rng, hot, row_start, num_rows, (300 if parallel else 40, 5))
    out, counts = tiered_gather(weight, hot, marked, row_start, ids, out_dtype, parallel)
    effective = weight.copy()
    effective[hot - row_start] = marked
    expected = reference_lookup(effective, ids - row_start, 0.5, out_dtype)
    # reference_lookup reads ids outside the shard as zero rows too
    np.testing.assert_array_equal(np.isnan(out.astype(np.float32)),
                                  np.isnan(expected.astype(np.float32)))
    finite = ~np.isnan(expected.astype(np.float32))
    bits = f"u{out.dtype.itemsize}"
    np.testing.assert_array_equal(out.view(bits)[finite], expected.view(bits)[finite])
    assert list(counts) == expected_counts(ids, hot, row_start, num_rows)


@pytest.mark.parametrize("hot_count", [0, 1, 64, 333])
def test_same_bytes_as_the_untiered_gather(hot_count):
    rng = np.random.default_rng(hot_count)
    num_rows, head_dim, row_start = 333, 16, 7
    weight = random_bits(rng, num_rows, head_dim, ml_dtypes.float8_e4m3fn)
    hot = np.sort(rng.choice(np.arange(row_start, row_start + num_rows), hot_count,
                             replace=False)).astype(np.int64)
    ids = adversarial_ids(rng, hot, row_start, num_rows, (50, 16)).astype(np.int32)
    out, counts = tiered_gather(weight, hot, weight[hot - row_start], row_start, ids,
                                ml_dtypes.bfloat16, False)
    plain = np.empty((50, 16 * head_dim), np.uint16)
    gather_rows(weight.view(np.uint8), formats.FLOAT8_E4M3, row_start, np.float32(0.5), ids,
                plain, formats.BFLOAT16)
    np.testing.assert_array_equal(out.view(np.uint16), plain)
    assert list(counts) == expected_counts(ids, hot, row_start, num_rows)


def test_prefetched_heads_are_not_read_again():
    rng = np.random.default_rng(5)
    weight = random_bits(rng, 100, 4, np.float16)
    hot = np.arange(0, 100, 3, dtype=np.int64)
    ids = rng.integers(0, 100, (20, 4))
    expected = ids.copy()
    expected[::2] = -5  # half the tokens changed since the prefetch
    hot_map = build_map(check_hot_rows(hot, 0, 100), 0, 100)
    out = np.zeros((20, 16), np.uint16)
    counts = np.zeros(2, np.int64)
    gather_rows(weight.view(np.uint16), formats.FLOAT16, 0, np.float32(1.0), ids, out,
                formats.FLOAT16, expected, hot=(hot_map, weight[hot].view(np.uint16)),
                counts=counts)
    changed = ids[::2]
    assert list(counts) == expected_counts(changed, hot, 0, 100)
    assert not out[1::2].any()  # skipped: left as they were


def test_tiered_cuda_instance_compiles():
    """The released shape's tiered instance: 16-byte loads, one popc for the slot, atomics."""
    nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    name = gather_cupy.instance_name(formats.FLOAT8_E4M3, formats.BFLOAT16, 16, np.int64, True)
    assert name == "gather_tiered_rows<3, 2, 16, long long>"
    program = nvrtc.createProgram(gather_cupy.kernel_source("gather.cu"), "gather.cu", [], [])
    try:
        nvrtc.addNameExpression(program, name)
        try:
            nvrtc.compileProgram(program, ["-arch=compute_90", *gather_cupy.NVRTC_OPTIONS])
        except nvrtc.NVRTCError:
            pytest.fail(nvrtc.getProgramLog(program))
        ptx = nvrtc.getPTX(program).decode()
        lowered = nvrtc.getLoweredName(program, name)
    finally:
        nvrtc.destroyProgram(program)
    body = ptx[ptx.index(f".entry {lowered}"):]
    body = body[: body.index("\n}\n")]
    assert "ld.global.nc.v4.u32" in body and "popc.b64" in body and "atom.global.add.u64" in body


@pytest.fixture(scope="module")
def host_gather():
    """kernels/gather.cu built by g++ and run thread by thread (see host_kernels)."""
    host_kernels = pytest.importorskip("host_kernels")
    if host_kernels.compiler() is None:
        pytest.skip("no g++ on PATH: gather.cu cannot be built for the host")
    return host_kernels.HostGather(host_kernels.build())


@pytest.mark.parametrize("head_dim", [1, 8, 160])
@pytest.mark.parametrize("dtype, out_dtype", PAIRS, ids=str)
def test_cuda_tiered_gather_equals_the_cpu_one(host_gather, dtype, out_dtype, head_dim):
    """gather_tiered_rows (host build) against the Numba tiered gather: a marked hot tier,
    shard edges, out-of-range ids, int32 and int64 ids, and the same counts."""
    rng = np.random.default_rng(head_dim)
    fmt, out_format = formats.storage_format(dtype), formats.output_format(out_dtype)
    num_rows, row_start = 130, 64
    weight = random_bits(rng, num_rows, head_dim, dtype)
    hot = np.unique(rng.integers(row_start, row_start + num_rows, 40))
    marked = random_bits(rng, hot.size, head_dim, dtype)
    hot_map = build_map(hot, row_start, num_rows)
    for id_dtype in (np.int32, np.int64):
        ids = adversarial_ids(rng, hot, row_start, num_rows, (23, 3))
        ids = np.clip(ids, np.iinfo(id_dtype).min, np.iinfo(id_dtype).max).astype(id_dtype)
        want, want_counts = tiered_gather(weight, hot, marked, row_start, ids, out_dtype, False)
        out = np.full(want.shape, 0xAB, out_format.raw)
        counts = np.zeros((gather_cupy.COUNTER_LANES, 2), np.uint64)
        plan = gather_cupy.launch_plan(weight.view(fmt.raw), fmt.code, row_start, 0.5, ids, out,
                                       out_format.code, None, (hot_map, marked.view(fmt.raw)),
                                       counts)
        assert plan.name.startswith("gather_tiered_rows<")
        host_gather.run(plan)
        np.testing.assert_array_equal(out, want.view(out_format.raw))
        np.testing.assert_array_equal(counts.sum(axis=0), want_counts)
