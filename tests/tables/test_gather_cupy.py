"""The GPU gather kernels checked on the CPU (host builds of dequant.cuh and gather.cu, the
Numba CUDA simulator), and GPU == CPU bit for bit on a device (compiles: test_gpu_compiles)."""

from __future__ import annotations

import ctypes
import dataclasses
import shutil
import subprocess

import host_kernels
import ml_dtypes
import numpy as np
import pytest
import simulator
from helpers import offset_array

import ngram_cupy as nc
from ngram_cupy.codecs import dequant
from ngram_cupy.codecs.dequant import FORMATS, OUTPUT_CODES, reference_lookup
from ngram_cupy.formats import PLAIN_FORMATS  # NVFP4's own tests: test_nvfp4
from ngram_cupy.ids import fused_cuda, ids_cuda
from ngram_cupy.tables import gather_cupy
from ngram_cupy.tables.gather_numba import gather_rows


def test_every_format_pair_has_instances():
    names = gather_cupy.all_instances()
    assert len(names) == len(set(names)) == 2 * 2 * 3 * (3 + 4 + 4 + 5 + 5 + 5)  # tiered or not
    assert "gather_rows<3, 2, 16, long long>" in names
    assert "gather_tiered_rows<3, 2, 16, long long>" in names
    assert "gather_rows<0, 0, 2, int>" not in names  # no load narrower than a value


@pytest.mark.parametrize("row_bytes, itemsize, out_itemsize, table, out, width", [
    (160, 1, 2, 0, 0, 16),        # released fp8 rows: 10 x 16-byte loads per row
    (160, 1, 2, 8, 0, 8),         # a table view starting 8 bytes in
    (160, 1, 2, 0, 8, 4),         # out 8-aligned only: 4 values, one 8-byte store
    (160, 1, 2, 0, 4, 2),         # out 4-aligned only: 2 values, one 4-byte store
    (12, 4, 2, 0, 0, 4),          # three float32 values per row
    (6, 2, 4, 0, 0, 2),
    (7, 1, 4, 0, 0, 1),
])
def test_vector_width(row_bytes, itemsize, out_itemsize, table, out, width):
    assert gather_cupy.vector_bytes(row_bytes, itemsize, out_itemsize, table, out) == width


# ---------------------------------------------------------------- the C++ twin, built on the host

HARNESS = """
#define NGRAM_HOST_TEST
#include "dequant.cuh"
template <int C, int O>
static void run(const unsigned* bits, long n, float scale, unsigned* out) {
    for (long i = 0; i < n; ++i) out[i] = ngram::convert<C, O>(bits[i], scale);
}
#define PAIR(C, O) if (code == C && out_code == O) { run<C, O>(bits, n, scale, out); return; }
extern "C" void convert_all(int code, int out_code, const unsigned* bits, long n, float scale,
                            unsigned* out) {
    PAIR(0, 0) PAIR(0, 1) PAIR(0, 2) PAIR(1, 0) PAIR(1, 1) PAIR(1, 2)
    PAIR(2, 0) PAIR(2, 1) PAIR(2, 2) PAIR(3, 0) PAIR(3, 1) PAIR(3, 2)
}
"""


@pytest.fixture(scope="module")
def host_dequant(tmp_path_factory):
    """kernels/dequant.cuh compiled for the host (plain IEEE float32, no fast math)."""
    compiler = shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    folder = tmp_path_factory.mktemp("dequant")
    source = folder / "harness.cpp"
    source.write_text(HARNESS)
    library = folder / "harness.so"
    subprocess.run([compiler, "-std=c++17", "-O2", "-shared", "-fPIC", "-ffp-contract=off",
                    f"-I{gather_cupy.KERNEL_DIR}", str(source), "-o", str(library)], check=True)
    convert_all = ctypes.CDLL(str(library)).convert_all
    convert_all.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_long,
                            ctypes.c_float, ctypes.c_void_p]
    return convert_all


def patterns(fmt) -> np.ndarray:
    """Every bit pattern of a 1- or 2-byte format; edge and random patterns of float32."""
    if fmt.itemsize < 4:
        return np.arange(1 << (8 * fmt.itemsize), dtype=np.uint32)
    rng = np.random.default_rng(0)
    edges = [0, 0x80000000, 1, 0x007FFFFF, 0x00800000, 0x33000000, 0x33000001, 0x387FE000,
             0x38800000, 0x477FEFFF, 0x477FF000, 0x7F7FFFFF, 0x7F800000, 0x7F800001, 0xFFC00000]
    return np.concatenate([np.array(edges, np.uint32),
                           rng.integers(0, 1 << 32, 200_000, dtype=np.uint64).astype(np.uint32)])


@pytest.mark.parametrize("fmt", PLAIN_FORMATS, ids=lambda f: f.name)
def test_cuda_dequant_header_equals_the_python_one(host_dequant, fmt):
    bits = patterns(fmt)
    table = bits.astype(fmt.raw).reshape(-1, 1)
    ids = np.arange(bits.size).reshape(-1, 1)
    for out_code in OUTPUT_CODES:
        for scale in (1.0, 0.5, 3.0e-5, -7.0, 1.0e30):
            from_cuda_header = np.empty(bits.size, np.uint32)
            host_dequant(fmt.code, out_code, bits.ctypes.data, bits.size, scale,
                         from_cuda_header.ctypes.data)
            out_raw = FORMATS[out_code].raw
            from_numba = np.empty((bits.size, 1), out_raw)
            # Serial: the threaded kernels (10 s a compile for float32) add nothing to the
            # decoding compared here; test_table runs them on every pattern.
            gather_rows(table, fmt.code, 0, np.float32(scale), ids, from_numba, out_code,
                        parallel=False)
            np.testing.assert_array_equal(from_cuda_header.astype(out_raw), from_numba[:, 0],
                                          err_msg=f"{fmt.name} -> {out_code}, scale {scale}")


# ---------------------------------------------------------------- gather.cu executed on the host




def edge_ids(rng, row_start: int, rows: int, shape, dtype) -> np.ndarray:
    """Random rows of the shard, with its first and last row, one past it, the row before it,
    -1 and the dtype's extremes among them."""
    info = np.iinfo(dtype)
    ids = rng.integers(row_start, row_start + rows, shape).astype(dtype)
    edges = [row_start, row_start + rows - 1, row_start + rows, row_start - 1, -1, info.min,
             info.max]
    ids.reshape(-1)[rng.permutation(ids.size)[: len(edges)]] = edges[: ids.size]
    return ids


def numba_gather(table, code, row_start, scale, ids, out_shape, out_code, expected=None,
                 out=None):
    """The reference every backend is compared with: the Numba CPU gather, on int64 ids (the
    same values: int32 ids would only add a compile per format pair; test_table and
    test_tiered run the Numba gather on int32 ids)."""
    out = np.zeros(out_shape, FORMATS[out_code].raw) if out is None else out
    return gather_rows(np.ascontiguousarray(table), code, row_start, np.float32(scale),
                       np.ascontiguousarray(ids, dtype=np.int64), out, out_code, expected)


@pytest.mark.parametrize("out_code", OUTPUT_CODES)
@pytest.mark.parametrize("fmt", PLAIN_FORMATS, ids=lambda f: f.name)
def test_host_built_gather_equals_numba(host_gather, fmt, out_code):
    """Every head_dim, id type, T x H not a multiple of the block, shard edges, out-of-range ids,
    and table / out views offset from 16-byte alignment: the plan picks narrower vectors, and no
    load or store is misaligned (the host build ends a launch on one)."""
    rng = np.random.default_rng(fmt.code * 3 + out_code)
    out_raw, out_size = FORMATS[out_code].raw, FORMATS[out_code].itemsize
    row_start, rows, scale = 5, 40, 0.375
    widths = set()
    for head_dim in (1, 3, 7, 8, 64, 160):
        bits = rng.integers(0, 1 << (8 * fmt.itemsize), (rows, head_dim), dtype=np.uint64)
        for table_offset, out_offset in [(0, 0), (fmt.itemsize, out_size), (8, 2 * out_size),
                                         (16 - fmt.itemsize, 8)]:
            table = offset_array((rows, head_dim), fmt.raw, table_offset)
            table[...] = bits.astype(fmt.raw)
            for shape, id_dtype in [((5, 3), np.int32), ((37, 7), np.int64), ((1, 1), np.int64)]:
                ids = edge_ids(rng, row_start, rows, shape, id_dtype)
                out_shape = (shape[0], shape[1] * head_dim)
                out = offset_array(out_shape, out_raw, out_offset)
                out[...] = 0xAB
                plan = gather_cupy.launch_plan(table, fmt.code, row_start, scale, ids, out,
                                               out_code)
                widths.add(int(plan.name.split(", ")[2]))
                assert plan.grid * plan.block >= ids.size * int(plan.args[6]) > (
                    plan.grid - 1) * plan.block
                host_gather.run(plan)
                want = numba_gather(table, fmt.code, row_start, scale, ids, out_shape, out_code)
                np.testing.assert_array_equal(
                    out, want, err_msg=f"{plan.name}, head_dim {head_dim}, table +"
                    f"{table_offset}, out +{out_offset}, ids {shape} {np.dtype(id_dtype)}")
    assert 16 in widths and min(widths) == fmt.itemsize  # the widest and narrowest paths ran


def test_host_built_gather_skips_expected_heads(host_gather):
    """Heads whose id equals ``expected`` keep what ``out`` holds (a prefetch wrote them)."""
    rng = np.random.default_rng(4)
    table = rng.integers(0, 256, (30, 160), dtype=np.uint8)
    ids = edge_ids(rng, 0, 30, (9, 16), np.int64)
    expected = np.where(rng.random(ids.shape) < 0.5, ids, ids + 1)
    out = np.full((9, 16 * 160), 0x1234, np.uint16)
    want = numba_gather(table, 3, 0, 0.5, ids, None, 2, expected, out=out.copy())
    host_gather.gather(table, 3, 0, 0.5, ids, out, 2, expected)
    np.testing.assert_array_equal(out, want)
    assert (out.reshape(9, 16, 160)[expected == ids] == 0x1234).all()


def test_a_misaligned_vector_load_fails_on_the_host(host_gather):
    """The host build's alignment check is live: a 16-byte load from a table 8 bytes off fails."""
    table = offset_array((4, 160), np.uint8, 0)
    ids = np.zeros((2, 1), np.int64)
    out = np.zeros((2, 160), np.uint16)
    plan = gather_cupy.launch_plan(table, 3, 0, 1.0, ids, out, 2)
    assert plan.name == "gather_rows<3, 2, 16, long long>"
    shifted = offset_array((4, 160), np.uint8, 8)
    with pytest.raises(host_kernels.MisalignedHostAccess, match="16-byte"):
        host_gather.run(dataclasses.replace(plan, args=(shifted, *plan.args[1:])))
    with pytest.raises(TypeError, match="argument 6"):  # chunks packed as int64, not int32
        host_gather.run(dataclasses.replace(plan, args=(*plan.args[:6], np.int64(10),
                                                        *plan.args[7:])))
    with pytest.raises(ValueError, match="aligned"):  # float16 rows one byte off: no plan
        gather_cupy.launch_plan(offset_array((4, 8), np.uint8, 1).view(np.uint16), 1, 0, 1.0,
                                ids, out, 2)


@pytest.mark.parametrize("num_items, head_dim", [
    (2**31 - 1, 1),   # the last launch on 32-bit index arithmetic
    (2**32 + 3, 1),   # 64-bit: a 32-bit index would wrap to item 2
    (2**30 + 5, 16),  # 64-bit through the pieces: 4 per row, 2**32 + 20 in all
], ids=["32-bit", "64-bit", "64-bit-chunks"])
def test_host_built_gather_index_paths(host_gather, num_items, head_dim):
    """Launches past 2**31 threads: only the first and last blocks run, over arrays whose pages
    exist only where touched."""
    try:
        ids = host_kernels.reserve((num_items, 1), np.int32)
        out = host_kernels.reserve((num_items, head_dim), np.float32)
    except (OSError, ValueError, OverflowError) as error:
        pytest.skip(f"cannot reserve the huge arrays: {error}")
    rng = np.random.default_rng(5)
    table = rng.standard_normal((50, head_dim)).astype(np.float32).view(np.uint32)
    tail = 600
    ids[:tail] = rng.integers(-2, 52, (tail, 1))
    ids[-tail:] = rng.integers(-2, 52, (tail, 1))
    out_bits = out.view(np.uint32)
    plan = gather_cupy.launch_plan(table, 0, 0, 0.5, ids, out_bits, 0)
    chunks = int(plan.args[6])
    assert plan.grid * plan.block >= num_items * chunks > (plan.grid - 1) * plan.block
    host_gather.run(plan, range(0, 1))
    host_gather.run(plan, range(plan.grid - 2, plan.grid))
    first = (plan.grid - 2) * plan.block // chunks  # the first item the last blocks touch
    for rows in (slice(0, plan.block // chunks), slice(first, num_items)):
        want = numba_gather(table, 0, 0, 0.5, ids[rows], (rows.stop - rows.start, head_dim), 0)
        np.testing.assert_array_equal(out_bits[rows], want)
    assert not out_bits[first - 8 : first].any()  # nothing outside the blocks run


# ---------------------------------------------------------------- Numba CUDA: simulator and PTX


def fused(layout, table, tokens, starts, context, out_format, block, write_ids=True,
          words=None):
    """``(rows, ids)`` from the fused kernel (simulated: see the ``simulate`` fixture)."""
    num_tokens = len(tokens)
    out = np.full((num_tokens, layout.num_heads * table.head_dim), 0xAB, out_format.raw)
    ids = np.full((num_tokens if write_ids else 1, layout.num_heads), -1, np.int64)
    raw = table.host_view.view(table.format.raw)
    words = fused_cuda.table_words(raw, table.format.itemsize) if words is None else words
    scale = table.lookup_scale(out_format)
    fused_cuda.launch_fused(layout, tokens, starts, context, ids_cuda.layout_params(layout),
                            words, table.format.code, table.row_start, scale, write_ids, ids, out,
                            out_format.code, block=block)
    return out, ids


def cpu_rows_and_ids(layout, table, tokens, starts, context, out_format):
    """``(rows, ids)`` from the CPU path: ids, then the Numba gather."""
    ids = nc.compute_ngram_ids(layout, tokens, starts, context)
    rows = table.lookup(ids, out_dtype=out_format.dtype)
    return rows.view(out_format.raw), ids


def every_pattern_table(rng, rows, head_dim, fmt):
    """Random bits of the format: NaNs, infinities and subnormals included."""
    bits = rng.integers(0, 1 << (8 * fmt.itemsize), (rows, head_dim), dtype=np.uint64)
    return bits.astype(fmt.raw).view(fmt.dtype)


@pytest.mark.parametrize("fmt", PLAIN_FORMATS, ids=lambda f: f.name)
def test_simulated_fused_kernel_equals_the_cpu_path(simulate, fmt):
    """Every output format, a row shard, a partial last block, EOS-heavy tokens."""
    rng = np.random.default_rng(1 + fmt.code)
    layout = simulator.layouts()[1]
    for out_code in OUTPUT_CODES:
        out_format = FORMATS[out_code]
        head_dim = 6 if fmt.itemsize < 4 else 3
        full = every_pattern_table(rng, layout.padded_rows, head_dim, fmt)
        start = layout.padded_rows // 3
        table = nc.EmbeddingTable(full[start : start + 80], scale=0.375, row_start=start,
                                  total_rows=layout.padded_rows)
        batch = simulator.wild_batch(rng, layout, 9, 3)
        got_rows, got_ids = fused(layout, table, *batch, out_format, block=4)
        want_rows, want_ids = cpu_rows_and_ids(layout, table, *batch, out_format)
        np.testing.assert_array_equal(got_ids, want_ids)
        np.testing.assert_array_equal(got_rows, want_rows, err_msg=f"{fmt.name}->{out_code}")


def test_simulated_fused_kernel_whole_tables_without_scale_and_ids(simulate):
    """Odd head dims (one value per word), int32 inputs, nothing written to ids."""
    rng = np.random.default_rng(2)
    for layout in simulator.layouts()[::2]:
        fmt = FORMATS[dequant.FLOAT8_E4M3]
        table = nc.EmbeddingTable(every_pattern_table(rng, layout.padded_rows, 5, fmt))
        batch = simulator.wild_batch(rng, layout, 6, 2, dtypes=(np.int32,) * 3)
        out_format = FORMATS[dequant.BFLOAT16]
        got_rows, got_ids = fused(layout, table, *batch, out_format, block=4, write_ids=False)
        np.testing.assert_array_equal(got_rows,
                                      cpu_rows_and_ids(layout, table, *batch, out_format)[0])
        assert np.all(got_ids == -1)


def test_simulated_fused_kernel_on_an_empty_batch(simulate):
    layout = simulator.layouts()[1]
    table = nc.EmbeddingTable(np.zeros((layout.padded_rows, 4), np.float32))
    rows, _ = fused(layout, table, np.zeros(0, np.int64), np.zeros(2, np.int64),
                    np.zeros((1, 2), np.int64), FORMATS[dequant.FLOAT32], block=4)
    assert rows.shape == (0, layout.num_heads * 4)


def test_simulated_fused_kernel_on_a_padded_batch(simulate):
    """Tokens past ``query_start_loc[R]`` (SPEC 10.3): the CPU path's ids and rows, in a block
    of padding alone too."""
    rng = np.random.default_rng(4)
    layout = simulator.layouts()[1]
    fmt = FORMATS[dequant.FLOAT8_E4M3]
    table = nc.EmbeddingTable(every_pattern_table(rng, layout.padded_rows, 4, fmt), scale=0.75)
    tokens, starts, context = simulator.wild_batch(rng, layout, 3, 2)
    padded = np.concatenate([tokens, rng.integers(0, 300, 6)])
    out_format = FORMATS[dequant.BFLOAT16]
    got_rows, got_ids = fused(layout, table, padded, starts, context, out_format, block=4)
    want_rows, want_ids = cpu_rows_and_ids(layout, table, padded, starts, context, out_format)
    np.testing.assert_array_equal(got_ids, want_ids)
    np.testing.assert_array_equal(got_rows, want_rows)


def test_the_simulator_refuses_a_misaligned_word_load(simulate):
    """The alignment check is live: 8-byte words read from an address 1 mod 8 fail."""
    layout = simulator.layouts()[1]
    table = nc.EmbeddingTable(np.zeros((layout.padded_rows, 8), np.uint8).view(
        ml_dtypes.float8_e4m3fn))
    shifted = offset_array((layout.padded_rows, 8), np.uint8, 1)
    batch = simulator.wild_batch(np.random.default_rng(0), layout, 2, 1)
    with pytest.raises(simulator.MisalignedAccess, match="uint64 elements"):
        fused(layout, table, *batch, FORMATS[dequant.BFLOAT16], block=4,
              words=shifted.view(np.uint64))


@pytest.mark.parametrize("offset", [1, 2, 4])
def test_fused_words_of_a_misaligned_table_load_aligned(simulate, offset):
    """A table view starting ``offset`` bytes past an 8-byte boundary (CuPy's ``.view`` of a
    shifted buffer, adopted by placement="gpu") gets words it can load aligned, and the fused
    kernel reads the same rows as the CPU path."""
    rng = np.random.default_rng(offset)
    layout = simulator.layouts()[1]
    fmt = FORMATS[dequant.FLOAT8_E4M3]
    weight = every_pattern_table(rng, layout.padded_rows, 16, fmt)
    table = nc.EmbeddingTable(weight, scale=0.5)
    shifted = offset_array(weight.shape, np.uint8, offset)
    shifted[...] = weight.view(np.uint8)
    words = fused_cuda.table_words(shifted, fmt.itemsize)
    batch = simulator.wild_batch(rng, layout, 5, 2)
    out_format = FORMATS[dequant.BFLOAT16]
    got_rows, _ = fused(layout, table, *batch, out_format, block=4, words=words)
    np.testing.assert_array_equal(got_rows, cpu_rows_and_ids(layout, table, *batch,
                                                             out_format)[0])


# ---------------------------------------------------------------- on a GPU (skipped without one)


def device_lookup(weight, ids, out_dtype, scale, **table_kwargs):
    """The GPU lookup's result as NumPy (bfloat16 bits viewed back)."""
    import cupy

    table = nc.EmbeddingTable(weight, scale=scale, placement="gpu", **table_kwargs)
    result = table.lookup(cupy.asarray(ids), out_dtype=out_dtype).get()
    return result.view(np.dtype(out_dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [np.float32, np.float16, ml_dtypes.bfloat16],
                         ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("fmt", PLAIN_FORMATS, ids=lambda f: f.name)
def test_gpu_equals_cpu_on_every_bit_pattern(fmt, out_dtype):
    bits = patterns(fmt)
    for head_dim in (160, 8, 3):
        rows = -(-bits.size // head_dim)
        padded = np.resize(bits, rows * head_dim).astype(fmt.raw).view(fmt.dtype)
        weight = padded.reshape(rows, head_dim)
        rng = np.random.default_rng(head_dim)
        for num_tokens, id_dtype in [(1, np.int64), (256, np.int32), (4097, np.int64)]:
            ids = rng.integers(0, rows, (num_tokens, 16)).astype(id_dtype)
            cpu = nc.EmbeddingTable(weight, scale=0.375).lookup(ids, out_dtype=out_dtype)
            gpu = device_lookup(weight, ids, out_dtype, 0.375)
            np.testing.assert_array_equal(gpu.view(np.uint8), cpu.view(np.uint8))


@pytest.mark.gpu
def test_gpu_shards_unaligned_out_and_reuse():
    import cupy

    rng = np.random.default_rng(1)
    weight = (rng.standard_normal((1000, 160)) * 8).astype(ml_dtypes.float8_e4m3fn)
    ids = rng.integers(0, 1000, (300, 16))
    expected = reference_lookup(weight, ids, 0.5, ml_dtypes.bfloat16)
    total = np.zeros(expected.shape, np.float32)
    for start, stop in [(0, 333), (333, 900), (900, 1000)]:
        shard = nc.EmbeddingTable(weight[start:stop], scale=0.5, placement="gpu",
                                  row_start=start, total_rows=1000)
        total += shard.lookup(cupy.asarray(ids)).get().view(ml_dtypes.bfloat16).astype(
            np.float32)
    np.testing.assert_array_equal(total, expected.astype(np.float32))
    table = nc.EmbeddingTable(weight, scale=0.5, placement="gpu")
    backing = cupy.zeros(300 * 2560 + 4, cupy.uint16)
    out = backing[2:-2].reshape(300, 2560)  # 4-byte aligned only: narrower loads
    for _ in range(2):
        assert table.lookup(cupy.asarray(ids.astype(np.int32)), out=out) is out
        np.testing.assert_array_equal(out.get().view(ml_dtypes.bfloat16), expected)
    assert not backing[:2].any() and not backing[-2:].any()


@pytest.mark.gpu
def test_fused_forward_equals_ids_then_lookup():
    import cupy

    config = nc.NGramConfig(vocab_size=248320, ngram_size=3, heads_per_ngram=8,
                            ngram_vocab_size_base=20_000, eos_token_id=248044,
                            embedding_dim=2560)
    layout = nc.layer_layout(config, 0)
    rng = np.random.default_rng(2)
    weight = (rng.standard_normal((layout.padded_rows, 160)) * 8).astype(
        ml_dtypes.float8_e4m3fn)
    for placement in ("gpu", "host"):
        table = nc.EmbeddingTable(weight, scale=0.25, placement=placement)
        plain = nc.NGramEmbedding(layout, table)
        fused = nc.NGramEmbedding(layout, table, fused=True)
        for num_tokens, num_requests in [(1, 1), (256, 256), (5000, 3)]:
            tokens = cupy.asarray(rng.integers(0, 248320, num_tokens))
            starts = cupy.asarray(np.linspace(0, num_tokens, num_requests + 1).astype(np.int64))
            context = cupy.asarray(rng.integers(0, 248320, (num_requests, 2)))
            want = plain(tokens, starts, context).get()
            np.testing.assert_array_equal(fused(tokens, starts, context).get(), want)
            ids = cupy.full((num_tokens, layout.num_heads), -1, cupy.int64)
            fused(tokens, starts, context, ids_out=ids)
            np.testing.assert_array_equal(ids.get(), plain.compute_ids(tokens, starts,
                                                                       context).get())
            cpu = nc.NGramEmbedding(layout, nc.EmbeddingTable(weight, scale=0.25))
            np.testing.assert_array_equal(
                cpu(tokens.get(), starts.get(), context.get()).view(np.uint16), want)


@pytest.mark.gpu
def test_cuda_graph_of_ids_and_lookup_replays():
    import cupy

    config = nc.NGramConfig(vocab_size=1000, ngram_size=3, heads_per_ngram=8,
                            ngram_vocab_size_base=5000, eos_token_id=3, embedding_dim=2560)
    layout = nc.layer_layout(config, 0)
    rng = np.random.default_rng(3)
    weight = (rng.standard_normal((layout.padded_rows, 160))).astype(ml_dtypes.float8_e4m3fn)
    layer = nc.NGramEmbedding(layout, nc.EmbeddingTable(weight, scale=0.5, placement="gpu"))
    tokens = cupy.asarray(rng.integers(0, 1000, 64))
    starts = cupy.asarray(np.arange(0, 65, 8))
    context = cupy.asarray(rng.integers(0, 1000, (8, 2)))
    out = cupy.empty((64, 2560), cupy.uint16)
    stream = cupy.cuda.Stream(non_blocking=True)
    cupy.cuda.Stream.null.synchronize()  # the inputs' copies: the stream does not wait for them
    with stream:
        layer(tokens, starts, context, out=out)  # warm-up: compile, allocate
        stream.begin_capture()
        layer(tokens, starts, context, out=out)
        graph = stream.end_capture()
        tokens[...] = cupy.asarray(rng.integers(0, 1000, 64))
        out[...] = 0
        graph.launch(stream)
        stream.synchronize()
    cpu = nc.NGramEmbedding(layout, nc.EmbeddingTable(weight, scale=0.5))
    np.testing.assert_array_equal(out.get(),
                                  cpu(tokens.get(), starts.get(), context.get()).view(np.uint16))
