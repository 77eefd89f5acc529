"""MXFP8 tables (SPEC 11 Tables): E4M3 rows with one UE8M0 scale byte per 32 values, decoded as
vLLM's lookup does, ``bf16(f32(e4m3) * S)`` with ``S`` the float32 of bits ``byte << 23``
(0.0 for byte 0, +inf for 255). The second block-scaled entry of the format registry: every
placement and gather (Numba CPU, ``gather.cu`` built for the host, tiered, the fused kernel in
the simulator) against a plain NumPy reference."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import simulator
from conftest import assert_same, laid_out
from helpers import every_pair_table
from mapped_table import MappedTable

import ngram_cupy as nc
from ngram_cupy.codecs.dequant import reference_block_lookup
from ngram_cupy.formats import FLOAT32, FORMATS, MXFP8, OUTPUT_CODES, find_format
from ngram_cupy.ids import fused_cuda, ids_cuda
from ngram_cupy.tables import gather_cupy
from ngram_cupy.tables.gather_numba import gather_rows
from ngram_cupy.tables.hot_rows import build_map

FMT = FORMATS[MXFP8]
E4M3 = ml_dtypes.float8_e4m3fn




IDS = np.arange(256, dtype=np.int64).reshape(64, 4)


def test_the_reference_reads_ue8m0_as_vllm_does():
    """2**(byte - 127) for 1..254, 0.0 for byte 0 and +inf for 255 (OCP says NaN there)."""
    one, nan = 0x38, 0x7F  # E4M3 1.0 and NaN
    weight = np.array([[one] * 32, [one] * 32, [one] * 32, [one] * 32, [nan] * 32, [0] * 32],
                      np.uint8)
    scales = np.array([[127], [128], [0], [255], [127], [255]], np.uint8)
    got = reference_block_lookup(FMT, weight, scales, 1.0, np.arange(6).reshape(6, 1),
                                 np.float32)[:, 0]
    assert got[0] == 1.0 and got[1] == 2.0 and got[2] == 0.0 and got[3] == np.inf
    assert np.isnan(got[4]) and np.isnan(got[5])  # NaN stays NaN; 0 * inf is NaN
    small = reference_block_lookup(FMT, np.full((1, 32), 1, np.uint8), np.array([[1]], np.uint8),
                                   1.0, np.zeros((1, 1), np.int64), np.float32)
    assert small[0, 0] == np.float32(2.0**-9 * 2.0**-126)  # subnormal E4M3 times 2**-126: kept


def test_every_pair_on_numba_and_host_built_cuda(host_gather):
    weight, scales = every_pair_table(FMT)
    for out_code in OUTPUT_CODES:
        fmt = FORMATS[out_code]
        want = reference_block_lookup(FMT, weight, scales, 1.0, IDS, fmt.dtype)
        # Threaded once per decoder: float16 and float32 outputs share the byte table's (a
        # threaded float32 gather was a 4 s compile of its own), bfloat16 shifts exponents.
        for parallel in (False, True) if out_code != FLOAT32 else (False,):
            numba = np.empty(want.shape, fmt.raw)
            gather_rows(weight, MXFP8, 0, np.float32(1.0), IDS, numba, out_code,
                        parallel=parallel, scales=scales)
            assert_same(numba, want, f"numba, {fmt.name}")
        widths = set()
        for offset in (0, 8, 4, 2, 1):  # 16- down to 1-byte loads
            backing = np.zeros(weight.nbytes + 128, np.uint8)
            start = -backing.ctypes.data % 64 + offset
            table = backing[start : start + weight.nbytes].reshape(weight.shape)
            table[...] = weight
            cuda = np.empty(want.shape, fmt.raw)
            plan = gather_cupy.launch_plan(table, MXFP8, 0, 1.0, IDS, cuda, out_code,
                                           scales=scales)
            widths.add(int(plan.name.split(", ")[2]))
            host_gather.run(plan)
            assert_same(cuda, want, f"{plan.name}")
        assert widths == {1, 2, 4, 8, 16}
        rows, row_scales = laid_out(weight, scales, FMT, packed=True)  # 272-byte records
        cuda = np.empty(want.shape, fmt.raw)
        host_gather.run(gather_cupy.launch_plan(rows, MXFP8, 0, 1.0, IDS, cuda, out_code,
                                                scales=row_scales))
        assert_same(cuda, want, f"packed records, {fmt.name}")


def test_numba_blocks_at_the_edges_of_the_exponent_shift():
    """The bf16 gather shifts exponents for scale bytes 10..246 (every E4M3 value stays a normal
    bf16) and multiplies for the rest: rows mixing blocks on both sides of each edge, the
    smallest subnormal results (byte 0..9), infinities (247..254) and the byte 255 table."""
    edges = np.array([9, 10, 246, 247, 0, 255, 1, 254, 127, 11, 245], np.uint8)
    weight = np.tile(np.arange(256, dtype=np.uint8), (len(edges), 1))
    scales = np.stack([np.roll(edges, -r)[:256 // 32] for r in range(len(edges))])
    ids = np.arange(len(edges), dtype=np.int64).reshape(-1, 1)
    want = reference_block_lookup(FMT, weight, scales, 1.0, ids, ml_dtypes.bfloat16)
    got = np.empty(want.shape, np.uint16)
    gather_rows(weight, MXFP8, 0, np.float32(1.0), ids, got,
                find_format(ml_dtypes.bfloat16).code, scales=scales)
    assert_same(got, want)
    exponents = want.view(np.uint16)[:2, :32] & 0x7F80  # the first blocks: bytes 9 and 10
    assert (exponents[0, 1:] == 0).any() and (exponents[1, 1:] != 0).all()  # subnormal at 9


def test_host_built_tiered_gather(host_gather):
    weight, scales = every_pair_table(FMT)
    hot = np.arange(0, 256, 3, dtype=np.int64)
    cold, cold_scales = weight.copy(), scales.copy()
    cold[hot], cold_scales[hot] = 0x7F, 0xFF  # a mixed-up read shows
    counts = np.zeros((gather_cupy.COUNTER_LANES, 2), np.uint64)
    out = np.empty((64, 4 * 256), np.uint16)
    host_gather.run(gather_cupy.launch_plan(cold, MXFP8, 0, 1.0, IDS, out, 2,
                                            hot=(build_map(hot, 0, 256), weight[hot]),
                                            counts=counts, scales=cold_scales,
                                            hot_scales=scales[hot]))
    assert_same(out, reference_block_lookup(FMT, weight, scales, 1.0, IDS, ml_dtypes.bfloat16))
    assert counts.sum(axis=0).tolist() == [hot.size, 256 - hot.size]


def test_every_host_placement_and_shard():
    weight, scales = every_pair_table(FMT)
    typed = weight.view(E4M3)
    start, total = 1000, 2000
    ids = IDS + start
    ids[0] = [0, start - 1, start + 256, total - 1]  # other ranks' rows: zeros
    pinned = nc.EmbeddingTable.empty(256, 256, "mxfp8", placement="pinned", row_start=start,
                                     total_rows=total)
    pinned.write_rows(start, typed[:100], scales[:100].view(ml_dtypes.float8_e8m0fnu))
    pinned.write_rows(start + 100, weight[100:], scales[100:])
    tables = [
        nc.EmbeddingTable(typed, dtype="mxfp8", block_scales=scales, row_start=start,
                          total_rows=total),
        pinned,
        nc.EmbeddingTable(typed, dtype="mxfp8", block_scales=scales, placement="pinned",
                          row_start=start, total_rows=total,
                          hot_rows=np.arange(start, start + 256, 5)),
        MappedTable([(start, typed[:128], scales[:128]), (start + 128, typed[128:], scales[128:])],
                    256, "mxfp8", None, start, start + 256, total),
    ]
    for table in tables:
        assert table.nbytes == 256 * (256 + 8) and table.format is FMT
        for out_code in OUTPUT_CODES:
            fmt = FORMATS[out_code]
            assert_same(table.lookup(ids, out_dtype=fmt.dtype),
                        reference_block_lookup(FMT, weight, scales, 1.0, ids, fmt.dtype, start),
                        repr(table))
        assert table.lookup(ids).dtype == ml_dtypes.bfloat16


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("tiered", [False, True])
def test_simulated_fused_kernel(simulate, tiered, packed):
    """Two arrays or packed records, with or without a hot tier: the reference's bits."""
    from ngram_cupy.tables.storage.tiered import DeviceTier

    rng = np.random.default_rng(9)
    layout = nc.layer_layout(nc.NGramConfig(50, 2, 1, 3, 0, embedding_dim=64), 0)
    rows = layout.padded_rows
    weight = rng.integers(0, 256, (rows, 64), dtype=np.uint8)
    scales = rng.integers(0, 256, (rows, 2), dtype=np.uint8)
    batch = simulator.wild_batch(rng, layout, 9, 3)
    ids = nc.compute_ngram_ids(layout, *batch)
    tier = None
    if tiered:
        hot_rows = np.arange(0, rows, 2)
        hot, hot_scales = laid_out(weight[hot_rows], scales[hot_rows], FMT, packed)
        tier = DeviceTier(build_map(hot_rows, 0, rows), hot,
                          np.zeros((gather_cupy.COUNTER_LANES, 2), np.uint64), hot_scales)
    table, table_scales = laid_out(weight, scales, FMT, packed)
    tables = fused_cuda.kernel_tables(table, 1, table_scales, tier)
    for out_code in OUTPUT_CODES:
        fmt = FORMATS[out_code]
        out = np.full((9, 64), 0xAB, fmt.raw)
        fused_cuda.launch_fused(layout, *batch, ids_cuda.layout_params(layout), code=MXFP8,
                                row_start=0, scale=1.0, write_ids=False,
                                ids_out=np.zeros((1, 1), np.int64), out=out, out_code=out_code,
                                block=4, **tables)
        assert_same(out, reference_block_lookup(FMT, weight, scales, 1.0, ids, fmt.dtype))


@pytest.mark.parametrize("kwargs, match", [
    (dict(scale=0.5), "mxfp8 tables take no scale"),
    (dict(block_scales=None), "block_scales are required"),
    (dict(block_scales=np.zeros((4, 2), np.uint8)), r"block_scales must have shape \(4, 1\)"),
    (dict(block_scales=np.zeros((4, 1), np.float32)), "block_scales must be float8_e8m0fnu"),
    (dict(weight=np.zeros((4, 48), E4M3)), "multiple of 32"),
])
def test_bad_mxfp8_tables_are_refused(kwargs, match):
    arguments = dict(weight=np.zeros((4, 32), E4M3), dtype="mxfp8",
                     block_scales=np.zeros((4, 1), np.uint8)) | kwargs
    with pytest.raises(ValueError, match=match):
        nc.EmbeddingTable(**arguments)
    with pytest.raises(ValueError, match="no scale"):
        nc.EmbeddingTable.empty(4, 32, "mxfp8", scale=1.0)


def test_torch_float8_e8m0fnu_block_scales():
    """torch's UE8M0 dtype (what safetensors.torch reads DeepSeek's F8_E8M0 .scale as) is taken
    as the scale bytes (it reached DLPack: 'Unsupported dtype'), and still refused by NVFP4."""
    import torch

    weight, scales = every_pair_table(FMT)
    rows = torch.from_numpy(weight).view(torch.float8_e4m3fn)
    ue8m0 = torch.from_numpy(scales).view(torch.float8_e8m0fnu)
    table = nc.EmbeddingTable(rows, dtype="mxfp8", block_scales=ue8m0)
    want = reference_block_lookup(FMT, weight, scales, 1.0, IDS, np.float32)
    assert_same(table.lookup(torch.from_numpy(IDS), out_dtype="float32").numpy(), want)
    table.write_rows(0, weight[:2], ue8m0[:2].flip(0))
    assert np.array_equal(table.host_scales[:2], scales[:2][::-1])
    with pytest.raises(ValueError, match="block_scales must be float8_e4m3fn"):
        nc.EmbeddingTable(torch.zeros((4, 8), dtype=torch.uint8), dtype="nvfp4",
                          block_scales=torch.zeros((4, 1), dtype=torch.float8_e8m0fnu))


def test_write_rows_takes_torch_float8_rows():
    """An MXFP8 table's rows are float8 e4m3: torch float8 rows are written (they were refused
    as 'rows must have dtype mxfp8', though the constructor takes them)."""
    import torch

    weight, scales = every_pair_table(FMT)
    table = nc.EmbeddingTable.empty(256, 256, "mxfp8")
    table.write_rows(0, torch.from_numpy(weight).view(torch.float8_e4m3fn), scales)
    want = reference_block_lookup(FMT, weight, scales, 1.0, IDS, np.float32)
    assert_same(table.lookup(IDS, out_dtype="float32"), want)
    with pytest.raises(TypeError, match="rows must have dtype mxfp8"):
        table.write_rows(0, torch.zeros((1, 256), dtype=torch.bfloat16), scales[:1])


def test_the_format_is_found_by_name_only():
    assert find_format("mxfp8") is FMT
    assert find_format(E4M3).code == 3 and find_format("F8_E4M3").code == 3  # plain float8


@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["gpu", "pinned"])
def test_gpu_lookups_equal_the_reference(placement):
    import cupy

    weight, scales = every_pair_table(FMT)
    table = nc.EmbeddingTable(weight.view(E4M3), dtype="mxfp8", block_scales=scales,
                              placement=placement)
    for out_code in OUTPUT_CODES:
        fmt = FORMATS[out_code]
        got = cupy.asnumpy(table.lookup(cupy.asarray(IDS), out_dtype=fmt.dtype))
        assert_same(got.view(fmt.raw).view(fmt.dtype),
                    reference_block_lookup(FMT, weight, scales, 1.0, IDS, fmt.dtype))
