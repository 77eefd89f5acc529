"""NVFP4 tables (SPEC 10.2) on every path, against the vectors vLLM 0.33's NVFP4 kernel computed
(tests/data/golden/nvfp4) and the plain NumPy reference: the Numba CPU gather, ``gather.cu``
built for the host, the fused ids + gather kernel in the CUDA simulator, every placement through
``EmbeddingTable`` (hot-row tier and row shards included); the GPU itself where there is one.
NaNs are compared as a class: their payload and sign differ between platforms."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import simulator
from conftest import assert_same, laid_out
from helpers import every_pair_table, offset_array
from mapped_table import MappedTable

import ngram_cupy as nc
from ngram_cupy.codecs.dequant import reference_block_lookup
from ngram_cupy.formats import FORMATS, NVFP4, OUTPUT_CODES, find_format
from ngram_cupy.ids import fused_cuda, ids_cuda
from ngram_cupy.tables import gather_cupy
from ngram_cupy.tables.gather_numba import gather_rows

GOLDEN = sorted((Path(__file__).resolve().parents[1] / "data" / "golden" / "nvfp4").glob("*.npz"))
FMT = FORMATS[NVFP4]
E4M3 = ml_dtypes.float8_e4m3fn
KEYS = {0: "f32", 1: "fp16", 2: "bf16"}  # output format code -> the golden file's suffix

if len(GOLDEN) != 3:  # a broken checkout must fail, not skip
    raise RuntimeError("the NVFP4 golden vectors are missing from tests/data/golden/nvfp4")


@pytest.fixture(params=GOLDEN, ids=lambda path: path.stem, scope="module")
def case(request) -> dict:
    """One golden case: its arrays, the owned rows' geometry as Python ints."""
    with np.load(request.param) as data:
        case = {name: data[name] for name in data.files}
    for name in ("vocab_start", "vocab_end", "total_rows", "dim"):
        case[name] = int(case[name])
    return case


def geometry(case) -> dict:
    return dict(row_start=case["vocab_start"], total_rows=case["total_rows"])


def assert_golden(got, case, out_code, message=""):
    """``got`` (output values or their bits) equals vLLM's kernel bits; NaN as a class."""
    fmt = FORMATS[out_code]
    bits = np.asarray(got).view(fmt.raw)
    want, nan = case[f"kernel_{KEYS[out_code]}"], case[f"nan_{KEYS[out_code]}"]
    np.testing.assert_array_equal(np.isnan(bits.view(fmt.dtype).astype(np.float32)), nan,
                                  err_msg=f"NaN positions, {fmt.name} {message}")
    np.testing.assert_array_equal(bits[~nan], want[~nan], err_msg=f"{fmt.name} {message}")




GLOBAL_SCALES = (1.0, 0.0064059207, 448.0 * 6.0, 1.0e-30, -0.75, 3.0e38)


# ---------------------------------------------------------------- the reference and the vectors

def test_the_plain_reference_equals_vllms_kernel(case):
    for out_code in OUTPUT_CODES:
        want = reference_block_lookup(FMT, case["weight"], case["weight_scale"],
                                      case["weight_scale_2"], case["ids"],
                                      FORMATS[out_code].dtype, case["vocab_start"])
        assert_golden(want, case, out_code)


def test_the_golden_cases_cover_the_edges():
    """NaN blocks, ids of other ranks and a row shard are in the data."""
    cases = [dict(np.load(path)) for path in GOLDEN]
    assert any(case["nan_bf16"].any() for case in cases)
    assert any(case["vocab_start"] > 0 for case in cases)
    assert any(((case["ids"] < case["vocab_start"]) | (case["ids"] >= case["vocab_end"])).any()
               for case in cases)


# ---------------------------------------------------------------- kernels

@pytest.mark.parametrize("parallel", [False, True])
def test_numba_gather_equals_the_kernel_vectors(case, parallel):
    for out_code in OUTPUT_CODES:
        out = np.full(case[f"kernel_{KEYS[out_code]}"].shape, 0xAB, FORMATS[out_code].raw)
        gather_rows(case["weight"], NVFP4, case["vocab_start"], case["weight_scale_2"],
                    case["ids"], out, out_code, parallel=parallel, scales=case["weight_scale"])
        assert_golden(out, case, out_code, f"parallel={parallel}")




def test_host_built_cuda_gather_equals_the_kernel_vectors(host_gather, case):
    """Every load width: the table at offsets that force 16- down to 1-byte loads."""
    widths = set()
    for offset in (0, 8, 4, 2, 1):
        table = offset_array(case["weight"].shape, np.uint8, offset)
        table[...] = case["weight"]
        for out_code in OUTPUT_CODES:
            out = np.full(case[f"kernel_{KEYS[out_code]}"].shape, 0xAB, FORMATS[out_code].raw)
            for ids in (case["ids"], case["ids"].astype(np.int32)):
                plan = gather_cupy.launch_plan(table, NVFP4, case["vocab_start"],
                                               case["weight_scale_2"], ids, out, out_code,
                                               scales=case["weight_scale"])
                widths.add(int(plan.name.split(", ")[2]))
                host_gather.run(plan)
                assert_golden(out, case, out_code, plan.name)
    assert min(widths) == 1 and max(widths) == min(16, case["weight"].shape[1])


@pytest.mark.parametrize("tiered", [False, True])
def test_host_built_cuda_gather_of_packed_records_equals_the_kernel_vectors(host_gather, case,
                                                                            tiered):
    """The golden rows as one record per row (a hot tier of records too), every output."""
    from ngram_cupy.tables.hot_rows import build_map

    rows, scales = laid_out(case["weight"], case["weight_scale"], FMT, packed=True)
    hot = np.arange(0, rows.shape[0], 2)
    hot_rows, hot_scales = laid_out(case["weight"][hot], case["weight_scale"][hot], FMT, True)
    tier = dict(hot=(build_map(hot, 0, rows.shape[0]), hot_rows), hot_scales=hot_scales,
                counts=np.zeros((gather_cupy.COUNTER_LANES, 2), np.uint64)) if tiered else {}
    for out_code in OUTPUT_CODES:
        out = np.full(case[f"kernel_{KEYS[out_code]}"].shape, 0xAB, FORMATS[out_code].raw)
        host_gather.run(gather_cupy.launch_plan(rows, NVFP4, case["vocab_start"],
                                                case["weight_scale_2"], case["ids"], out,
                                                out_code, scales=scales, **tier))
        assert_golden(out, case, out_code, f"packed, tiered={tiered}")


def test_every_block_scale_and_code_pair_on_cpu_and_host_built_cuda(host_gather):
    weight, scales = every_pair_table(FMT)
    ids = np.arange(256, dtype=np.int64).reshape(64, 4)
    for scale in GLOBAL_SCALES:
        for out_code in OUTPUT_CODES:
            fmt = FORMATS[out_code]
            want = reference_block_lookup(FMT, weight, scales, scale, ids, fmt.dtype)
            numba = np.empty(want.shape, fmt.raw)
            gather_rows(weight, NVFP4, 0, np.float32(scale), ids, numba, out_code, scales=scales)
            assert_same(numba, want, f"numba, scale {scale}, {fmt.name}")
            cuda = np.empty(want.shape, fmt.raw)
            host_gather.run(gather_cupy.launch_plan(weight, NVFP4, 0, scale, ids, cuda, out_code,
                                                    scales=scales))
            assert_same(cuda, want, f"gather.cu, scale {scale}, {fmt.name}")


def test_host_built_tiered_gather_reads_hot_rows_and_their_scales(host_gather, case):
    """Hot rows come from the hot tier with the hot tier's scales: the tier here holds the
    right rows, the cold table garbage in those rows, so a mixed-up read shows."""
    from ngram_cupy.tables.hot_rows import build_map

    rows = case["weight"].shape[0]
    hot = np.arange(0, rows, 2, dtype=np.int64)
    cold, cold_scales = case["weight"].copy(), case["weight_scale"].copy()
    cold[hot], cold_scales[hot] = 0x77, 0x7F
    counts = np.zeros((gather_cupy.COUNTER_LANES, 2), np.uint64)
    out = np.zeros(case["kernel_bf16"].shape, np.uint16)
    plan = gather_cupy.launch_plan(cold, NVFP4, case["vocab_start"], case["weight_scale_2"],
                                   case["ids"], out, 2, hot=(build_map(hot, 0, rows),
                                                             case["weight"][hot]),
                                   counts=counts, scales=cold_scales,
                                   hot_scales=case["weight_scale"][hot])
    host_gather.run(plan)
    assert_golden(out, case, 2)
    local = case["ids"] - case["vocab_start"]
    owned = (local >= 0) & (local < rows)
    assert counts[:, 0].sum() == (owned & (local % 2 == 0)).sum()


# ---------------------------------------------------------------- the table, every placement

def nvfp4_tables(case, hot_every=3):
    """The golden table as: an adopted-then-copied array, ``empty`` + ``write_rows`` (pinned,
    float8-typed scales), a hot-row tier, and mapped blocks (two of them)."""
    weight, scales, scale = case["weight"], case["weight_scale"], case["weight_scale_2"]
    rows, start = weight.shape[0], case["vocab_start"]
    yield nc.EmbeddingTable(weight, dtype="nvfp4", block_scales=scales, scale=scale,
                            **geometry(case))
    pinned = nc.EmbeddingTable.empty(rows, case["dim"], "nvfp4", placement="pinned",
                                     scale=scale, **geometry(case))
    half = rows // 2
    pinned.write_rows(start, weight[:half], scales[:half].view(E4M3))
    pinned.write_rows(start + half, weight[half:], scales[half:])
    yield pinned
    hot = np.arange(start, start + rows, hot_every)
    yield nc.EmbeddingTable(weight, dtype="nvfp4", block_scales=scales, scale=scale,
                            placement="pinned", hot_rows=hot, **geometry(case))
    yield MappedTable([(start, weight[:half], scales[:half]),
                       (start + half, weight[half:], scales[half:])],
                      case["dim"], "nvfp4", scale, start, start + rows, case["total_rows"])


def test_every_host_placement_equals_the_kernel_vectors(case):
    for table in nvfp4_tables(case):
        assert table.head_dim == case["dim"] and table.format is FMT
        for out_code in OUTPUT_CODES:
            result = table.lookup(case["ids"], out_dtype=FORMATS[out_code].dtype)
            assert_golden(result, case, out_code, repr(table))
        assert table.lookup(case["ids"]).dtype == ml_dtypes.bfloat16  # the default output


def test_prefetch_then_lookup_equals_the_kernel_vectors(case):
    table = next(nvfp4_tables(case))
    table.prefetch(case["ids"])
    assert_golden(table.lookup(case["ids"]), case, 2)


def test_a_tier_counts_and_stays_current_through_write_rows(case):
    *_, tiered, _ = nvfp4_tables(case, hot_every=2)
    table = tiered
    table.lookup(case["ids"])
    assert table.counters["hot_rows"] > 0
    rows = case["weight"].shape[0]
    start = case["vocab_start"]
    table.write_rows(start, np.zeros((rows, case["dim"] // 2), np.uint8),
                     np.zeros((rows, case["dim"] // 16), np.uint8))
    assert not table.lookup(case["ids"], out_dtype=np.float32).any()
    table.write_rows(start, case["weight"], case["weight_scale"])
    assert_golden(table.lookup(case["ids"], out_dtype=np.float32), case, 0)


def test_row_shards_together_give_the_whole_table(case):
    """The case's rows split over three shards: each gives its rows, zeros elsewhere; the sum of
    the three float32 lookups is the whole table's (NaN rows aside)."""
    weight, scales = case["weight"], case["weight_scale"]
    start, rows = case["vocab_start"], weight.shape[0]
    cuts = [0, rows // 3, 2 * rows // 3, rows]
    total = np.zeros(case["kernel_f32"].shape, np.float32)
    for lo, hi in zip(cuts[:-1], cuts[1:], strict=True):
        shard = nc.EmbeddingTable(weight[lo:hi], dtype="nvfp4", block_scales=scales[lo:hi],
                                  scale=case["weight_scale_2"], row_start=start + lo,
                                  total_rows=case["total_rows"])
        part = shard.lookup(case["ids"], out_dtype=np.float32)
        assert_same(part, reference_block_lookup(FMT, weight[lo:hi], scales[lo:hi],
                                                 case["weight_scale_2"], case["ids"],
                                                 np.float32, start + lo))
        total += np.nan_to_num(part)
    want = case["kernel_f32"].view(np.float32)
    np.testing.assert_array_equal(total[~case["nan_f32"]], want[~case["nan_f32"]])


def test_sizes_count_the_block_scales():
    table = nc.EmbeddingTable.empty(1000, 160, "nvfp4")
    assert table.nbytes == 1000 * 90 == 1000 * FMT.row_bytes(160)
    assert table.host_view.shape == (1000, 80) and table.host_scales.shape == (1000, 10)


# ---------------------------------------------------------------- the fused kernel (simulated)

@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("tiered", [False, True])
def test_simulated_fused_kernel_equals_the_cpu_path(simulate, case, tiered, packed):
    """The golden rows as a layout's table (its first rows, a shard of them, hot rows), in two
    arrays or packed records: the fused kernel's rows equal the CPU lookup of its ids, itself
    equal to vLLM's bits."""
    from ngram_cupy.tables.hot_rows import build_map
    from ngram_cupy.tables.storage.tiered import DeviceTier

    rng = np.random.default_rng(case["dim"])
    config = nc.NGramConfig(50, 2, 1, 3, 0, embedding_dim=case["dim"])
    layout = nc.layer_layout(config, 0)
    rows = min(layout.padded_rows, case["weight"].shape[0])
    weight, scales = case["weight"][:rows], case["weight_scale"][:rows]
    start = 1
    table = nc.EmbeddingTable(weight[start:], dtype="nvfp4", block_scales=scales[start:],
                              scale=case["weight_scale_2"], row_start=start,
                              total_rows=layout.padded_rows)
    batch = simulator.wild_batch(rng, layout, 9, 3)
    ids = nc.compute_ngram_ids(layout, *batch)
    kernel_rows, kernel_scales = laid_out(weight[start:], scales[start:], FMT, packed)
    tier = None
    if tiered:
        hot_rows = np.arange(0, rows - start, 2)
        hot, hot_scales = laid_out(weight[start:][hot_rows], scales[start:][hot_rows], FMT,
                                   packed)
        tier = DeviceTier(build_map(hot_rows, 0, rows - start), hot, np.zeros(
            (gather_cupy.COUNTER_LANES, 2), np.uint64), hot_scales)
    tables = fused_cuda.kernel_tables(kernel_rows, 1, kernel_scales, tier)
    assert (tables["scale_column"] > 0) == packed
    for out_code in OUTPUT_CODES:
        fmt = FORMATS[out_code]
        out = np.full((len(batch[0]), layout.num_heads * case["dim"]), 0xAB, fmt.raw)
        ids_out = np.full(ids.shape, -1, np.int64)
        fused_cuda.launch_fused(layout, *batch, ids_cuda.layout_params(layout), code=NVFP4,
                                row_start=start, scale=table.lookup_scale(fmt), write_ids=True,
                                ids_out=ids_out, out=out, out_code=out_code, block=4, **tables)
        np.testing.assert_array_equal(ids_out, ids)
        assert_same(out, table.lookup(ids, out_dtype=fmt.dtype), f"{fmt.name}, tiered={tiered}")
        assert_same(out, reference_block_lookup(FMT, weight[start:], scales[start:],
                                                case["weight_scale_2"], ids, fmt.dtype, start))


def test_the_fused_kernel_refuses_nvfp4_rows_without_scales(simulate):
    layout = simulator.layouts()[0]
    batch = simulator.wild_batch(np.random.default_rng(0), layout, 3, 1)
    words = np.zeros((layout.padded_rows, 1), np.uint64)
    out = np.zeros((3, layout.num_heads * 16), np.uint16)
    with pytest.raises(ValueError, match="block scales"):
        fused_cuda.launch_fused(layout, *batch, ids_cuda.layout_params(layout), words, NVFP4, 0,
                                1.0, False, np.zeros((1, 1), np.int64), out, 2)


# ---------------------------------------------------------------- bad input

WEIGHT = np.zeros((4, 8), np.uint8)  # head_dim 16
SCALES = np.zeros((4, 1), np.uint8)


@pytest.mark.parametrize("kwargs, match", [
    (dict(block_scales=None), "block_scales are required"),
    (dict(block_scales=np.zeros((4, 2), np.uint8)), r"block_scales must have shape \(4, 1\)"),
    (dict(block_scales=np.zeros((3, 1), np.uint8)), r"block_scales must have shape"),
    (dict(block_scales=np.zeros((4, 1), np.float32)), "block_scales must be float8_e4m3fn"),
    (dict(block_scales=np.zeros((4, 1), np.uint16)), "block_scales must be float8_e4m3fn"),
    (dict(weight=np.zeros((4, 4), np.uint8), block_scales=np.zeros((4, 0), np.uint8)),
     "multiple of 16"),
    (dict(weight=np.zeros((4, 12), np.uint8), block_scales=np.zeros((4, 1), np.uint8)),
     "multiple of 16"),
    (dict(scale=float("nan")), "scale must be finite"),
    (dict(scale=float("inf")), "scale must be finite"),
    (dict(scale=np.array([1.0, 2.0], np.float32)), "scale must be a single value"),
])
def test_bad_nvfp4_tables_are_refused(kwargs, match):
    arguments = dict(weight=WEIGHT, dtype="nvfp4", block_scales=SCALES, scale=1.0) | kwargs
    with pytest.raises(ValueError, match=match):
        nc.EmbeddingTable(**arguments)


def test_packed_bytes_are_not_cast():
    """Float or wider weights are not NVFP4 bytes; float8 rows are not either."""
    for weight in (np.zeros((4, 8), np.float32), np.zeros((4, 8), np.float16),
                   np.zeros((4, 8), E4M3)):
        with pytest.raises(TypeError, match="cannot hold nvfp4"):
            nc.EmbeddingTable(weight, dtype="nvfp4", block_scales=SCALES)
    with pytest.raises(ValueError, match="only for block-scaled"):
        nc.EmbeddingTable(np.zeros((4, 16), E4M3), scale=1.0, block_scales=SCALES)


def test_bad_writes_write_nothing():
    table = nc.EmbeddingTable(WEIGHT + 0x22, dtype="nvfp4", block_scales=SCALES + 0x38)
    before = table.host_view.copy(), table.host_scales.copy()
    for rows, scales, error, match in [
        (WEIGHT, None, ValueError, "block_scales are required"),
        (WEIGHT, np.zeros((4, 2), np.uint8), ValueError, "block_scales must have shape"),
        (WEIGHT, np.zeros((4, 1), np.float32), ValueError, "block_scales must be"),
        (np.zeros((4, 16), np.uint8), SCALES, ValueError, r"head_dim / 2=8"),
        (WEIGHT.view(E4M3), SCALES, TypeError, "rows must have dtype nvfp4"),
    ]:
        with pytest.raises(error, match=match):
            table.write_rows(0, rows, scales)
    np.testing.assert_array_equal(table.host_view, before[0])
    np.testing.assert_array_equal(table.host_scales, before[1])
    with pytest.raises(ValueError, match="head_dim"):
        nc.EmbeddingTable.empty(4, 24, "nvfp4")
    with pytest.raises(ValueError, match="scale must be finite"):
        nc.EmbeddingTable.empty(4, 16, "nvfp4", scale=float("nan"))


def test_the_format_is_found_by_name_only():
    assert find_format("nvfp4") is FMT and find_format("NVFP4") is FMT
    assert find_format(np.uint8) is None and find_format("U8") is None


# ---------------------------------------------------------------- on a GPU

@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["gpu", "pinned"])
@pytest.mark.parametrize("hot", [False, True])
def test_gpu_lookups_equal_the_kernel_vectors(case, placement, hot):
    import cupy

    if hot and placement == "gpu":
        pytest.skip("a hot tier sits over host rows")
    rows, start = case["weight"].shape[0], case["vocab_start"]
    table = nc.EmbeddingTable(case["weight"], dtype="nvfp4", block_scales=case["weight_scale"],
                              scale=case["weight_scale_2"], placement=placement,
                              hot_rows=np.arange(start, start + rows, 2) if hot else None,
                              **geometry(case))
    for out_code in OUTPUT_CODES:
        for dedup in (False, True):
            table.dedup = dedup
            result = table.lookup(cupy.asarray(case["ids"]), out_dtype=FORMATS[out_code].dtype)
            assert_golden(cupy.asnumpy(result), case, out_code, f"{placement}, dedup={dedup}")


@pytest.mark.gpu
def test_gpu_fused_forward_equals_the_cpu_path(case):
    import cupy

    config = nc.NGramConfig(50, 2, 1, 3, 0, embedding_dim=case["dim"])
    layout = nc.layer_layout(config, 0)
    rows = min(layout.padded_rows, case["weight"].shape[0])
    table = nc.EmbeddingTable(case["weight"][:rows], dtype="nvfp4",
                              block_scales=case["weight_scale"][:rows],
                              scale=case["weight_scale_2"], placement="pinned",
                              total_rows=layout.padded_rows)
    batch = simulator.wild_batch(np.random.default_rng(1), layout, 64, 5)
    fused = nc.NGramEmbedding(layout, table, fused=True)
    got = fused(*(cupy.asarray(part) for part in batch))
    want = table.lookup(nc.compute_ngram_ids(layout, *batch))
    assert_same(cupy.asnumpy(got).view(ml_dtypes.bfloat16), want)


# ---------------------------------------------------------------- checkpoints in vLLM's layout

CONFIG = nc.NGramConfig(1000, 3, 2, 100, 5, embedding_dim=4 * 32, split_ngram_parts=3,
                        ple_embedding_dtype="nvfp4")


def random_nvfp4(layout, seed=0):
    """Packed bytes of every value, finite E4M3 block scales."""
    rng = np.random.default_rng(seed)
    weight = rng.integers(0, 256, (layout.padded_rows, layout.head_dim // 2), dtype=np.uint8)
    scales = rng.integers(0, 0x7F, (layout.padded_rows, layout.head_dim // 16), dtype=np.uint8)
    return weight, scales


def test_a_checkpoint_round_trips_in_vllms_names_and_dtypes(tmp_path):
    from ngram_cupy.files.safetensors_files import read_header

    layout = nc.layer_layout(CONFIG, 0)
    weight, scales = random_nvfp4(layout)
    files = nc.save_ngram_embedding(tmp_path, CONFIG, 0, weight, scale=np.float32(0.25),
                                    block_scales=scales.view(E4M3))
    header = {name: info for file in files for name, info in read_header(file).items()}
    prefix = "model.layers.0.ple.ple_embedding.ngram_embedding"
    for i, rows in enumerate((140, 140, 140)):
        assert header[f"{prefix}.shard_{i}.weight"].dtype == "U8"
        assert header[f"{prefix}.shard_{i}.weight"].shape == (rows, 16)
        assert header[f"{prefix}.shard_{i}.weight_scale"].dtype == "F8_E4M3"
        assert header[f"{prefix}.shard_{i}.weight_scale"].shape == (rows, 2)
    assert header[f"{prefix}.weight_scale_2"].dtype == "F32"
    assert f"{prefix}.weight_scale" not in header
    ids = np.random.default_rng(1).integers(-3, layout.padded_rows + 3, (20, 4))
    config = nc.NGramConfig.from_hf(tmp_path)
    for placement in ("cpu", "pinned", "mmap"):
        for rank in range(2):
            layer = nc.load_ngram_embedding(tmp_path, config, 0, placement=placement, rank=rank,
                                            world_size=2)
            table = layer.table
            lo, hi = table.row_start, table.row_start + table.num_rows
            for out_code in OUTPUT_CODES:
                fmt = FORMATS[out_code]
                assert_same(table.lookup(ids, out_dtype=fmt.dtype),
                            reference_block_lookup(FMT, weight[lo:hi], scales[lo:hi], 0.25, ids,
                                                   fmt.dtype, lo), f"{placement}, rank {rank}")


def test_the_golden_table_through_a_checkpoint(tmp_path, case):
    """vLLM's kernel vectors from a table saved and loaded (the owned rows padded with zeros)."""
    rows = case["total_rows"]
    config = nc.NGramConfig(1000, 2, 1, rows - 1, 5, embedding_dim=case["dim"],
                            split_ngram_parts=2, ple_embedding_dtype="nvfp4")
    layout = nc.layer_layout(config, 0)
    if layout.padded_rows < case["vocab_end"]:
        pytest.skip("the layout is smaller than the case")
    weight = np.zeros((layout.padded_rows, case["dim"] // 2), np.uint8)
    scales = np.zeros((layout.padded_rows, case["dim"] // 16), np.uint8)
    weight[case["vocab_start"]:case["vocab_end"]] = case["weight"]
    scales[case["vocab_start"]:case["vocab_end"]] = case["weight_scale"]
    nc.save_ngram_embedding(tmp_path, config, 0, weight, scale=case["weight_scale_2"],
                            block_scales=scales)
    table = nc.load_ngram_embedding(tmp_path, config, 0).table
    owned = (case["ids"] >= case["vocab_start"]) & (case["ids"] < case["vocab_end"])
    zero_row = case["vocab_start"] - 1 if case["vocab_start"] else layout.padded_rows - 1
    ids = np.where(owned, case["ids"], zero_row)  # the other ranks' rows are zeros here too
    for out_code in OUTPUT_CODES:
        assert_golden(table.lookup(ids, out_dtype=FORMATS[out_code].dtype), case, out_code)


def write_tensors(path, tensors):
    from ngram_cupy.files.safetensors_files import write_checkpoint

    write_checkpoint(path / "model.safetensors", tensors)
    return path / "model.safetensors"


def good_tensors():
    layout = nc.layer_layout(CONFIG, 0)
    weight, scales = random_nvfp4(layout)
    from ngram_cupy.files.checkpoint_writing import ngram_tensors

    return ngram_tensors(layout, weight, np.float32(0.5), block_scales=scales)


P = "model.layers.0.ple.ple_embedding.ngram_embedding"


@pytest.mark.parametrize("change, match", [
    (lambda t: t.update({f"{P}.shard_1.weight": t[f"{P}.shard_1.weight"].view(E4M3)}),
     "shard_1.weight has dtype F8_E4M3 but"),
    (lambda t: t.update({f"{P}.shard_0.weight": t[f"{P}.shard_0.weight"].view(E4M3)}),
     "a cast would reinterpret them"),
    (lambda t: t.pop(f"{P}.shard_2.weight_scale"), "1 of 3 block scale shards"),
    (lambda t: t.update({f"{P}.shard_1.weight_scale": t[f"{P}.shard_1.weight_scale"][:, :1]}),
     r"shard_1.weight_scale must be F8_E4M3 of shape \(140, 2\)"),
    (lambda t: t.update({f"{P}.shard_1.weight_scale":
                         t[f"{P}.shard_1.weight_scale"].view(np.uint8)}),
     "must be F8_E4M3"),
    (lambda t: t.update({f"{P}.weight": np.zeros((420, 16), np.uint8)}),
     "an unsharded nvfp4 weight is refused"),
    (lambda t: t.pop(f"{P}.weight_scale_2"), "weight_scale_2 .* is missing"),
    (lambda t: t.update({f"{P}.weight_scale_2": np.array(np.nan, np.float32)}),
     "must be a finite positive number"),
    (lambda t: t.update({f"{P}.weight_scale_2": np.array([1.0, 2.0], np.float32)}),
     "must hold one float"),
    (lambda t: t.update({f"{P}.shard_0.weight": t[f"{P}.shard_0.weight"][:, :8]}),
     r"must be \(140, 16\)"),
])
def test_bad_nvfp4_checkpoints_are_refused(tmp_path, change, match):
    tensors = good_tensors()
    change(tensors)
    path = write_tensors(tmp_path, tensors)
    with pytest.raises(ValueError, match=match):
        nc.load_ngram_embedding(path, CONFIG, 0)


def test_an_nvfp4_checkpoint_under_another_dtype_is_refused(tmp_path):
    path = write_tensors(tmp_path, good_tensors())
    config = nc.NGramConfig(**{**CONFIG.__dict__, "ple_embedding_dtype": "float8_e4m3fn"})
    with pytest.raises(ValueError, match="holds an NVFP4 table"):
        nc.load_ngram_embedding(path, config, 0)


@pytest.mark.parametrize("arguments, match", [
    (dict(weight=np.zeros((420, 16), np.float32)), "packed uint8 bytes"),
    (dict(weight=np.zeros((420, 32), np.uint8)), r"head_dim / 2\) = \(420, 16\)"),
    (dict(block_scales=np.zeros((420, 1), np.uint8)), "block_scales must have shape"),
    (dict(block_scales=np.zeros((420, 2), np.float32)), "block_scales must be float8_e4m3fn"),
    (dict(scale=None), "scale .* is required"),
    (dict(scale=np.float32(np.inf)), "finite positive"),
])
def test_bad_nvfp4_saves_write_nothing(tmp_path, arguments, match):
    layout = nc.layer_layout(CONFIG, 0)
    weight, scales = random_nvfp4(layout)
    given = dict(weight=weight, scale=np.float32(0.5), block_scales=scales) | arguments
    with pytest.raises(ValueError, match=match):
        nc.save_ngram_embedding(tmp_path / "out", CONFIG, 0, given["weight"],
                                scale=given["scale"], block_scales=given["block_scales"])
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- the torch module

def saved_checkpoint(tmp_path):
    layout = nc.layer_layout(CONFIG, 0)
    weight, scales = random_nvfp4(layout, 3)
    nc.save_ngram_embedding(tmp_path / "model.safetensors", CONFIG, 0, weight,
                            scale=np.float32(0.375), block_scales=scales)
    return weight, scales


def module_batch():
    import torch

    rng = np.random.default_rng(4)
    tokens = torch.from_numpy(rng.integers(0, 1000, 12))
    return tokens, torch.tensor([0, 5, 12]), torch.from_numpy(rng.integers(0, 1000, (2, 2)))


@pytest.mark.parametrize("order", ["as stored", "scales first"])
def test_the_module_loads_vllms_nvfp4_names(tmp_path, order):
    import torch
    from safetensors import safe_open

    from ngram_cupy.torch import NGramEmbeddingModule

    saved_checkpoint(tmp_path)
    prefix = "model.layers.0.ple.ple_embedding."
    module = NGramEmbeddingModule(CONFIG, 0, placement="cpu", weight_dtype="nvfp4")
    assert module.out_dtype == torch.bfloat16
    with safe_open(tmp_path / "model.safetensors", "pt") as checkpoint:
        names = sorted(checkpoint.keys(), reverse=order == "scales first")
        weights = [(name.removeprefix(prefix), checkpoint.get_tensor(name)) for name in names]
    first = [entry for entry in weights if entry[0].endswith("shard_0.weight")]
    module.load_weights(first)
    # rows without their block scales are not loaded; the global scale is tracked like a shard
    assert module.missing_shards == [0, 1, 2, "ngram_embedding.weight_scale_2"]
    loaded = module.load_weights(weights)
    assert loaded >= {"ngram_embedding.weight", "ngram_embedding.weight_scale",
                      "ngram_embedding.weight_scale_2"}
    assert module.missing_shards == [] and module.table.scale == np.float32(0.375)
    library = nc.load_ngram_embedding(tmp_path / "model.safetensors", CONFIG, 0)
    batch = module_batch()
    want = library(*(t.numpy() for t in batch))
    got = module(None, *batch)
    assert got.dtype == torch.bfloat16
    np.testing.assert_array_equal(got.view(torch.int16).numpy(), want.view(np.int16))


def test_the_module_state_dict_round_trips():
    import torch

    from ngram_cupy.torch import NGramEmbeddingModule

    layout = nc.layer_layout(CONFIG, 0)
    weight, scales = random_nvfp4(layout, 5)
    module = NGramEmbeddingModule(CONFIG, 0, placement="cpu")
    module.table.write_rows(0, weight, scales)
    module.ngram_embedding.set_global_scale(torch.tensor(0.5))
    state = {name: value.clone() for name, value in module.state_dict().items()}
    assert state["ngram_embedding.weight_scale"].dtype == torch.float8_e4m3fn
    other = NGramEmbeddingModule(CONFIG, 0, placement="cpu",
                                 hot_rows=np.arange(0, layout.padded_rows, 3))
    other.load_state_dict(state)
    batch = module_batch()
    np.testing.assert_array_equal(other(None, *batch).view(torch.int16).numpy(),
                                  module(None, *batch).view(torch.int16).numpy())
    assert other.table.scale == np.float32(0.5)


@pytest.mark.parametrize("assign", [False, True])
@pytest.mark.parametrize("name, value, match", [
    ("ngram_embedding.weight_scale", lambda scales: scales.float(), "must be torch.float8_e4m3fn"),
    ("ngram_embedding.weight_scale", lambda scales: scales[:3], r"of shape \(420, 2\)"),
    ("ngram_embedding.weight_scale_2", lambda _: np.float32(np.nan), "finite positive"),
    ("ngram_embedding.weight_scale_2", lambda _: np.ones(2, np.float32), "one floating"),
])
def test_a_bad_nvfp4_state_dict_changes_nothing(assign, name, value, match):
    """load_state_dict refuses bad block scales or global scale before any buffer or the
    table changes (assign=True would leave a foreign tensor, detached from the table; a NaN
    global scale left in the buffer marked the table loaded at scale 1)."""
    import torch

    from ngram_cupy.torch import NGramEmbeddingModule

    layout = nc.layer_layout(CONFIG, 0)
    weight, scales = random_nvfp4(layout, 5)
    source = NGramEmbeddingModule(CONFIG, 0, placement="cpu")
    source.table.write_rows(0, weight, scales)
    state = {key: tensor.clone() for key, tensor in source.state_dict().items()}
    bad = value(state[name])
    state[name] = bad if isinstance(bad, torch.Tensor) else torch.from_numpy(np.asarray(bad))
    module = NGramEmbeddingModule(CONFIG, 0, placement="cpu")
    before = module.ngram_embedding.weight_scale.data_ptr()
    with pytest.raises(ValueError, match=match):
        module.load_state_dict(state, assign=assign)
    assert module.ngram_embedding.weight_scale.data_ptr() == before
    assert module.ngram_embedding.weight_scale.dtype == torch.float8_e4m3fn
    assert float(module.ngram_embedding.weight_scale_2) == 1.0 and module.table.scale == 1.0
    assert module.missing_shards == [0, 1, 2, "ngram_embedding.weight_scale_2"]


def test_a_float16_module_rounds_nvfp4_rows_once_to_float16():
    """vLLM decodes NVFP4 rows in the lookup, to the model's dtype: an fp16 model's rows are
    rounded once to fp16 (bf16 then fp16 loses bits), through forward, prefetch and a copy."""
    import copy

    import torch

    from ngram_cupy.torch import NGramEmbeddingModule

    layout = nc.layer_layout(CONFIG, 0)
    weight, scales = random_nvfp4(layout, 5)
    module = NGramEmbeddingModule(CONFIG, 0, placement="cpu", out_dtype=torch.float16,
                                  return_stored_rows=True)
    module.table.write_rows(0, weight, scales)
    module.ngram_embedding.set_global_scale(torch.tensor(0.3))
    batch = module_batch()
    ids = module.compute_ngram_ids(*batch).numpy()
    want = reference_block_lookup(FORMATS[NVFP4], weight, scales, np.float32(0.3), ids,
                                  np.float16)
    got = module(*batch)
    assert got.dtype == torch.float16
    assert_same(got.numpy(), want)
    module.start_prefetch(*batch)
    assert_same(module(*batch).numpy(), want)
    assert_same(module.dequantize(got, torch.float16).numpy(), want)
    assert_same(copy.deepcopy(module)(*batch).numpy(), want)
    with pytest.raises(TypeError, match="out_dtype"):
        NGramEmbeddingModule(CONFIG, 0, placement="cpu", out_dtype=torch.int8)


@pytest.mark.parametrize("entry, error, match", [
    (("ngram_embedding.weight", np.zeros((420, 16), np.uint8)), ValueError, "unsharded nvfp4"),
    (("ngram_embedding.weight_scale", np.zeros((420, 2), np.uint8)), ValueError,
     "unsharded nvfp4"),
    (("ngram_embedding.shard_0.weight", np.zeros((140, 16), np.float32)), TypeError,
     "the table stores torch.uint8"),
    (("ngram_embedding.shard_0.weight", np.zeros((140, 32), np.uint8)), ValueError,
     r"must be \(140, 16\)"),
    (("ngram_embedding.shard_0.weight_scale", np.zeros((140, 1), np.uint8)), ValueError,
     r"must be float8_e4m3fn of shape \(140, 2\)"),
    (("ngram_embedding.shard_0.weight_scale", np.zeros((140, 2), np.float32)), ValueError,
     "must be float8_e4m3fn"),
    (("ngram_embedding.shard_3.weight_scale", np.zeros((140, 2), np.uint8)), ValueError,
     "at or past split_ngram_parts"),
    (("ngram_embedding.weight_scale_2", np.array(np.nan, np.float32)), ValueError,
     "finite positive"),
    (("ngram_embedding.weight_scale_2", np.ones(2, np.float32)), ValueError, "one floating"),
])
def test_the_module_refuses_bad_nvfp4_weights(entry, error, match):
    import torch

    from ngram_cupy.torch import NGramEmbeddingModule

    module = NGramEmbeddingModule(CONFIG, 0, placement="cpu")
    with pytest.raises(error, match=match):
        module.load_weights([(entry[0], torch.from_numpy(entry[1]))])
    assert module.table.scale == np.float32(1.0)


# ---------------------------------------------------------------- sizes: planning and the CLI

def test_plan_placement_counts_96_bytes_a_row(released_config):
    """Tables in memory hold one 96-byte record a row (90 bytes in a checkpoint)."""
    from ngram_cupy.tables.plan import table_nbytes

    layout = nc.layer_layout(released_config, 0)
    assert table_nbytes(layout, "nvfp4") == layout.padded_rows * 96 == 30_720_147_456
    plan = nc.plan_placement([(layout, "nvfp4")] * 3, gpu_budget_bytes=60 << 30,
                             host_budget_bytes=30 << 30)
    assert len(plan.names("gpu")) == 2 and len(plan.names("host")) == 1  # 28.6 GiB each
    odd = nc.layer_layout(nc.NGramConfig(1000, 2, 1, 100, 5, embedding_dim=24), 0)
    with pytest.raises(ValueError, match="multiple of 16"):
        table_nbytes(odd, "nvfp4")
    table = nc.EmbeddingTable(np.zeros((7, 80), np.uint8), dtype="nvfp4", scale=1.0,
                              block_scales=np.zeros((7, 10), np.uint8))
    assert table_nbytes(table) == 7 * 96 and table.nbytes == 7 * 90  # memory, checkpoint


def layout_lines(capsys, config: Path) -> dict[str, str]:
    """``ngram-cupy layout --config config``: its table lines by format name."""
    from ngram_cupy.cli.main import main

    assert main(["layout", "--config", str(config)]) == 0
    lines = capsys.readouterr().out.splitlines()
    return {line.split()[0]: line for line in lines if line.startswith("  ")}


def test_the_layout_command_prints_bytes_per_row_in_memory_and_checkpoints(capsys):
    lines = layout_lines(capsys, Path(__file__).resolve().parents[2] / "data" / "config.json")
    assert lines["nvfp4"].endswith("28.6 GiB  (96 B per row in memory, 90 B in a checkpoint)")
    assert lines["float8_e4m3fn"].endswith(
        "47.7 GiB  (160 B per row in memory, 160 B in a checkpoint)")
    assert lines["bfloat16"].endswith("(320 B per row in memory, 320 B in a checkpoint)")
    assert "(640 B per row in memory, 640 B in a checkpoint)" in lines["float32"]
    assert lines["mxfp8"].endswith("(176 B per row in memory, 165 B in a checkpoint)")


def test_the_layout_command_prints_mxfp8_records(tmp_path, capsys):
    """MXFP8 at head_dim 256 (DeepSeek Engram's): 256 + 8 -> 272 bytes in memory."""
    from ngram_cupy.files.config_json import write_config_json

    write_config_json(tmp_path, nc.NGramConfig(1000, 3, 2, 100, 5, embedding_dim=4 * 256))
    lines = layout_lines(capsys, tmp_path)
    assert lines["mxfp8"].endswith("(272 B per row in memory, 264 B in a checkpoint)")
    assert lines["nvfp4"].endswith("(144 B per row in memory, 144 B in a checkpoint)")
    assert lines["float8_e4m3fn"].endswith("(256 B per row in memory, 256 B in a checkpoint)")


def test_the_vectors_as_read_from_their_files():
    """The ``.npz`` fields passed as they load (0-d arrays for the geometry and the scale)."""
    for path in GOLDEN:
        with np.load(path) as data:
            table = nc.EmbeddingTable(data["weight"], dtype="nvfp4",
                                      block_scales=data["weight_scale"],
                                      scale=data["weight_scale_2"], row_start=data["vocab_start"],
                                      total_rows=data["total_rows"])
            case = {name: data[name] for name in data.files}
        for out_code in OUTPUT_CODES:
            assert_golden(table.lookup(case["ids"], out_dtype=FORMATS[out_code].name), case,
                          out_code)
