"""The hot-row tier: each id read from the hot rows when hot, from the table otherwise, with the
untiered table's bytes for every id (hot, cold, out of range, row-sharded), and exact counts."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import simulator

import ngram_cupy as nc
from ngram_cupy import formats
from ngram_cupy.codecs.dequant import reference_lookup
from ngram_cupy.hashing import reference
from ngram_cupy.ids import fused_cuda, ids_cuda
from ngram_cupy.runtime.backends import DEVICE
from ngram_cupy.tables import gather_cupy
from ngram_cupy.tables.gather_numba import gather_rows
from ngram_cupy.tables.hot_rows import build_map, check_hot_rows
from ngram_cupy.tables.storage import Gather

# 4 heads of prime sizes 11, 13, 17, 19: 60 rows padded to 64, cut in 6 shards of 11.
TINY = nc.NGramConfig(
    vocab_size=50, ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=11, eos_token_id=0,
    embedding_dim=16, make_ngram_vocab_size_divisible_by=8, split_ngram_parts=6,
)
PAIRS = [(np.float32, np.float32), (np.float16, np.float16), (ml_dtypes.bfloat16, np.float32),
         (ml_dtypes.float8_e4m3fn, ml_dtypes.bfloat16), (ml_dtypes.float8_e4m3fn, np.float16)]


def random_bits(rng, rows: int, head_dim: int, dtype) -> np.ndarray:
    """Random bit patterns of ``dtype`` (NaNs, infinities and subnormals included)."""
    fmt = formats.storage_format(dtype)
    bits = rng.integers(0, 1 << (8 * fmt.itemsize), (rows, head_dim), dtype=np.uint64)
    return bits.astype(fmt.raw).view(fmt.dtype)


def adversarial_ids(rng, hot, row_start, num_rows, shape, total_rows=None):
    """Hot rows, cold rows, the first and last rows, ids just outside, negative ids (but those
    outside ``[0, total_rows)`` when given: a table refuses them)."""
    stop = row_start + num_rows
    pool = np.concatenate([hot, rng.integers(row_start, stop, hot.size + 8),
                           [row_start, stop - 1, row_start - 1, stop, -1, -(1 << 40), 1 << 40]])
    if total_rows is not None:
        pool = pool[(pool >= 0) & (pool < total_rows)]
    return rng.choice(pool, shape).astype(np.int64)


# The tables' total rows: ids past their rows, up to 1 << 40, are other shards' (zero rows).
WHOLE = (1 << 40) + 1


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
        # The Numba reference on int64 ids (the same values; its int32 path is checked above).
        want, want_counts = tiered_gather(weight, hot, marked, row_start, ids.astype(np.int64),
                                          out_dtype, False)
        out = np.full(want.shape, 0xAB, out_format.raw)
        counts = np.zeros((gather_cupy.COUNTER_LANES, 2), np.uint64)
        plan = gather_cupy.launch_plan(weight.view(fmt.raw), fmt.code, row_start, 0.5, ids, out,
                                       out_format.code, None, (hot_map, marked.view(fmt.raw)),
                                       counts)
        assert plan.name.startswith("gather_tiered_rows<")
        host_gather.run(plan)
        np.testing.assert_array_equal(out, want.view(out_format.raw))
        np.testing.assert_array_equal(counts.sum(axis=0), want_counts)


# ---- the fused ids + gather kernel over the tier (Numba CUDA simulator) ----

def simulated_fused(layout, table, batch, out_format, hot=None, write_ids=False):
    """``(rows, ids, counts)`` of the fused kernel in the simulator (``simulate`` fixture) over
    ``table``'s rows; ``hot = ((words, ranks), raw hot rows)``: the tiered kernel."""
    tokens, starts, context = batch
    raw = table.host_view.view(table.format.raw)
    out = np.full((len(tokens), layout.num_heads * table.head_dim), 0xAB, out_format.raw)
    ids = np.full((len(tokens) if write_ids else 1, layout.num_heads), -1, np.int64)
    counts = np.zeros((gather_cupy.COUNTER_LANES, 2), np.uint64)
    if hot is None:
        words = fused_cuda.table_words(raw, table.format.itemsize)
    else:
        words = fused_cuda.table_words(raw, table.format.itemsize, hot[1])
        hot = (hot[0], hot[1].view(words.dtype))
    scale = 1.0 if table.scale is None else table.scale
    fused_cuda.launch_fused(layout, tokens, starts, context, ids_cuda.layout_params(layout),
                            words, table.format.code, table.row_start, scale, write_ids, ids, out,
                            out_format.code, block=4, hot=hot, counts=counts)
    return out, ids, counts.sum(axis=0)


def fused_case(rng, layout, fmt, head_dim, num_tokens, shard=True):
    """A row shard of random bits (a whole table when not ``shard``), a batch, the reference
    ids, and hot rows: about half the ids the batch reads from the shard, its edges, others."""
    weight = random_bits(rng, layout.padded_rows, head_dim, fmt.dtype)
    start, stop = (layout.padded_rows // 3, layout.padded_rows // 3 + 80) if shard else (
        0, layout.padded_rows)
    batch = simulator.wild_batch(rng, layout, num_tokens, 3)
    ids = reference.compute_ngram_ids(layout, *batch)
    owned = ids[(ids >= start) & (ids < stop)]
    hot = np.unique(np.concatenate([owned[::2], [start, stop - 1],
                                    rng.integers(start, stop, 10)])).astype(np.int64)
    return weight[start:stop], start, batch, ids, hot


@pytest.mark.parametrize("fmt", formats.PLAIN_FORMATS, ids=lambda f: f.name)
def test_simulated_fused_tier_equals_the_reference(simulate, fmt):
    """Every output format, a row shard, a marked hot tier (unlike the cold rows: it proves the
    source of every row): the reference ids' rows from the tier they are in, and the counts."""
    rng = np.random.default_rng(20 + fmt.code)
    layout = simulator.layouts()[1]
    head_dim = 6 if fmt.itemsize < 4 else 3
    for out_code in formats.OUTPUT_CODES:
        out_format = formats.FORMATS[out_code]
        weight, start, batch, want_ids, hot = fused_case(rng, layout, fmt, head_dim, 9)
        table = nc.EmbeddingTable(weight, scale=0.375, placement="pinned", row_start=start,
                                  total_rows=layout.padded_rows, hot_rows=hot)
        marked = random_bits(rng, hot.size, head_dim, fmt.dtype)
        rows, ids, counts = simulated_fused(layout, table, batch, out_format,
                                            (table.storage.map, marked.view(fmt.raw)), True)
        np.testing.assert_array_equal(ids, want_ids)
        effective = weight.copy()
        effective[hot - start] = marked
        expected = reference_lookup(effective, want_ids - start, 0.375, out_format.dtype)
        got = rows.view(out_format.dtype)
        nan = np.isnan(expected.astype(np.float32))
        np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan)
        np.testing.assert_array_equal(rows[~nan], expected.view(out_format.raw)[~nan],
                                      err_msg=f"{fmt.name} -> {out_format.name}")
        assert list(counts) == expected_counts(want_ids, hot, start, weight.shape[0])
        assert counts[0] > 0 and counts[1] > 0


@pytest.mark.parametrize("hot_share", [0.0, 0.5, 1.0])
def test_simulated_fused_tier_gives_the_untiered_fused_bytes(simulate, hot_share):
    """A true hot tier (the table's own rows): bit for bit the untiered fused kernel, NaNs
    included, on a whole table, with int32 inputs and no hot rows, some, or every one."""
    rng = np.random.default_rng(30)
    layout = simulator.layouts()[0]
    fmt = formats.FORMATS[formats.FLOAT8_E4M3]
    weight = random_bits(rng, layout.padded_rows, 8, fmt.dtype)
    hot = np.flatnonzero(rng.random(layout.padded_rows) < hot_share).astype(np.int64)
    tiered = nc.EmbeddingTable(weight, scale=0.5, placement="pinned", hot_rows=hot)
    plain = nc.EmbeddingTable(weight, scale=0.5)
    batch = simulator.wild_batch(rng, layout, 7, 2, dtypes=(np.int32,) * 3)
    out_format = formats.FORMATS[formats.BFLOAT16]
    storage = tiered.storage
    got, _, counts = simulated_fused(layout, tiered, batch, out_format,
                                     (storage.map, storage.host_hot.view(fmt.raw)))
    want, _, _ = simulated_fused(layout, plain, batch, out_format)
    np.testing.assert_array_equal(got, want)
    ids = reference.compute_ngram_ids(layout, *batch)
    assert list(counts) == expected_counts(ids, hot, 0, layout.padded_rows)


def test_simulated_fused_tier_equals_the_cuda_tiered_gather(simulate, host_gather):
    """The Numba slot map (fused kernel, simulated) and its CUDA C twin (``gather_tiered_rows``,
    host build) on the same map and ids: the same bytes and the same counts per tier."""
    rng = np.random.default_rng(40)
    layout = simulator.layouts()[1]
    fmt, out_format = (formats.FORMATS[code] for code in (formats.FLOAT16, formats.FLOAT32))
    weight, start, batch, ids, hot = fused_case(rng, layout, fmt, 4, 8)
    table = nc.EmbeddingTable(weight, placement="pinned", row_start=start,
                              total_rows=layout.padded_rows, hot_rows=hot)
    marked = random_bits(rng, hot.size, 4, fmt.dtype).view(fmt.raw)
    rows, _, counts = simulated_fused(layout, table, batch, out_format,
                                      (table.storage.map, marked))
    out = np.full(rows.shape, 0xAB, out_format.raw)
    cuda_counts = np.zeros((gather_cupy.COUNTER_LANES, 2), np.uint64)
    plan = gather_cupy.launch_plan(weight.view(fmt.raw), fmt.code, start, 1.0, ids, out,
                                   out_format.code, None, (table.storage.map, marked),
                                   cuda_counts)
    host_gather.run(plan)
    np.testing.assert_array_equal(rows, out)
    np.testing.assert_array_equal(counts, cuda_counts.sum(axis=0))


def test_fused_words_fit_the_table_and_the_tier():
    """The tier is read with the table's words: as wide as both addresses allow."""
    base = np.zeros(256, np.uint8)
    aligned = base[-base.ctypes.data % 16:][:64].reshape(4, 16)
    shifted = base[-base.ctypes.data % 16 + 100:][:32].reshape(2, 16)  # 4 past 16: 4-byte words
    assert fused_cuda.table_words(aligned, 1).dtype == np.uint64
    assert fused_cuda.table_words(aligned, 1, shifted).dtype == np.uint32
    layout = simulator.layouts()[0]
    words = np.zeros((layout.padded_rows, 2), np.uint64)
    with pytest.raises(ValueError, match="words of the table's width"):
        fused_cuda.launch_fused(layout, np.zeros(1, np.int64), np.array([0, 1]),
                                np.zeros((1, 1), np.int64), ids_cuda.layout_params(layout),
                                words, formats.FLOAT8_E4M3, 0, 1.0, False,
                                np.zeros((1, 1), np.int64), np.zeros((1, 16), np.uint16), 2,
                                hot=((np.zeros(1, np.uint64), np.zeros(1, np.uint32)),
                                     np.zeros((1, 4), np.uint32)),
                                counts=np.zeros((64, 2), np.uint64))


# ---- EmbeddingTable(..., hot_rows=...) ----

def tiered_and_plain(weight, hot, placement="pinned", **kwargs):
    """The same rows as a tiered table and as a plain CPU table."""
    kwargs.setdefault("total_rows", WHOLE)
    return (nc.EmbeddingTable(weight, placement=placement, hot_rows=hot, **kwargs),
            nc.EmbeddingTable(weight.copy(), **kwargs))


# Pinned (ordinary memory without a GPU) for every format pair; the caller's array adopted by
# placement="cpu" as the cold rows for one.
TABLE_CASES = [(*pair, "pinned") for pair in PAIRS] + [(np.float32, np.float32, "cpu")]


@pytest.mark.parametrize("dtype, out_dtype, placement", TABLE_CASES, ids=str)
def test_tiered_table_equals_the_plain_one(dtype, out_dtype, placement):
    rng = np.random.default_rng(11)
    weight = random_bits(rng, 200, 8, dtype)
    hot = np.unique(rng.integers(0, 200, 50))
    tiered, plain = tiered_and_plain(weight, hot, placement, scale=0.75)
    assert tiered.counters == {"hot_rows": 0, "cold_rows": 0} and plain.counters == {}
    ids = adversarial_ids(rng, hot, 0, 200, (64, 4), WHOLE)
    got = tiered.lookup(ids, out_dtype=out_dtype)
    np.testing.assert_array_equal(got.view(f"u{got.itemsize}"),
                                  plain.lookup(ids, out_dtype=out_dtype).view(f"u{got.itemsize}"))
    hot_read, cold_read = expected_counts(ids, hot, 0, 200)
    assert tiered.counters == {"hot_rows": hot_read, "cold_rows": cold_read}
    torch = pytest.importorskip("torch")
    # torch in, torch out, in the case's output dtype (another would only add a gather compile)
    out = torch.empty((64, 32), dtype=getattr(torch, np.dtype(out_dtype).name))
    assert tiered.lookup(torch.from_numpy(ids), out=out) is out
    bits = getattr(torch, f"int{8 * got.itemsize}")
    np.testing.assert_array_equal(out.view(bits).numpy().view(f"u{got.itemsize}"),
                                  got.view(f"u{got.itemsize}"))
    assert tiered.counters["hot_rows"] == 2 * hot_read


def test_row_sharded_tiered_tables_sum_to_the_table():
    rng = np.random.default_rng(12)
    rows, head_dim = 300, 4
    weight = random_bits(rng, rows, head_dim, np.float16)
    weight.view(np.uint16)[(weight.view(np.uint16) & 0x7C00) == 0x7C00] = 0  # no inf/NaN sums
    hot = np.unique(rng.integers(0, rows, 120))
    ids = adversarial_ids(rng, hot, 0, rows, (40, 8), rows)
    total = np.zeros((40, 8 * head_dim), np.float32)
    counted = 0
    for start, stop in [(0, 64), (64, 200), (200, 300)]:
        shard_hot = hot[(hot >= start) & (hot < stop)]
        shard = nc.EmbeddingTable(weight[start:stop], placement="pinned", row_start=start,
                                  total_rows=rows, hot_rows=shard_hot)
        total += shard.lookup(ids, out_dtype=np.float32)
        counted += sum(shard.counters.values())
        assert shard.counters["hot_rows"] == expected_counts(ids, shard_hot, start,
                                                             stop - start)[0]
    np.testing.assert_array_equal(total, reference_lookup(weight, ids, 1.0, np.float32))
    assert counted == int(((ids >= 0) & (ids < rows)).sum())


def test_written_rows_reach_the_hot_tier():
    rng = np.random.default_rng(13)
    weight = random_bits(rng, 100, 16, ml_dtypes.float8_e4m3fn)
    hot = np.array([0, 5, 31, 32, 63, 64, 99], np.int64) + 1000
    table = nc.EmbeddingTable.empty(100, 16, "float8_e4m3fn", placement="pinned", scale=2.0,
                                    row_start=1000, total_rows=1100, hot_rows=hot)
    for start in range(0, 100, 30):  # blocks cutting through the hot rows
        table.write_rows(1000 + start, weight[start:start + 30])
    ids = np.concatenate([hot, rng.integers(1000, 1100, 9)]).reshape(4, 4)
    np.testing.assert_array_equal(
        table.lookup(ids, out_dtype=np.float32),
        reference_lookup(weight, ids - 1000, 2.0, np.float32))
    assert table.counters == {"hot_rows": 7 + int(np.isin(ids.ravel()[7:], hot).sum()),
                              "cold_rows": 9 - int(np.isin(ids.ravel()[7:], hot).sum())}


def test_rows_changed_in_place_reach_the_hot_tier_on_refresh():
    rng = np.random.default_rng(17)
    weight = random_bits(rng, 100, 4, np.float16)
    hot = np.array([0, 7, 64, 99], np.int64)
    table = nc.EmbeddingTable(weight, placement="pinned", hot_rows=hot)
    ids = np.array([[0, 7, 64, 99], [1, 8, 65, 98]])
    new = random_bits(rng, 100, 4, np.float16)
    table.host_view[...] = new  # behind the tier's back: hot copies stale
    stale = table.lookup(ids).view(np.uint16)
    np.testing.assert_array_equal(stale[0], nc.EmbeddingTable(weight).lookup(ids)[0].view(
        np.uint16))
    table.refresh_hot_rows()
    np.testing.assert_array_equal(table.lookup(ids).view(np.uint16),
                                  nc.EmbeddingTable(new).lookup(ids).view(np.uint16))
    nc.EmbeddingTable(weight).refresh_hot_rows()  # untiered: nothing to do


def test_prefetch_through_the_tier():
    rng = np.random.default_rng(14)
    weight = random_bits(rng, 500, 8, ml_dtypes.bfloat16)
    hot = np.unique(rng.integers(0, 500, 100))
    tiered, plain = tiered_and_plain(weight, hot)
    first = adversarial_ids(rng, hot, 0, 500, (300, 3), WHOLE)
    changed = first.copy()
    changed[::3] = adversarial_ids(rng, hot, 0, 500, changed[::3].shape, WHOLE)
    tiered.prefetch(first)
    got = tiered.lookup(changed)
    np.testing.assert_array_equal(got.view(np.uint16), plain.lookup(changed).view(np.uint16))
    differs = changed[changed != first]
    assert sum(tiered.counters.values()) == (expected_counts(first, hot, 0, 500)[0]
                                             + expected_counts(first, hot, 0, 500)[1]
                                             + sum(expected_counts(differs, hot, 0, 500)))


@pytest.mark.parametrize("prefetch_dtype, reads", [(np.float32, 1), (None, 2)])
def test_a_prefetch_of_another_output_type_is_discarded_and_counted(prefetch_dtype, reads):
    """A lookup uses a prefetch of its own output type (unchanged ids: nothing read again);
    a prefetch of the default type (bfloat16 here) read as float32 is gathered and counted,
    then discarded, and the lookup reads every row again."""
    rng = np.random.default_rng(21)
    weight = random_bits(rng, 300, 8, ml_dtypes.bfloat16)
    hot = np.unique(rng.integers(0, 300, 60))
    tiered, plain = tiered_and_plain(weight, hot)
    ids = adversarial_ids(rng, hot, 0, 300, (50, 3), WHOLE)
    tiered.prefetch(ids, out_dtype=prefetch_dtype)
    got = tiered.lookup(ids, out_dtype=np.float32)
    np.testing.assert_array_equal(got, plain.lookup(ids, out_dtype=np.float32))
    hot_read, cold_read = expected_counts(ids, hot, 0, 300)
    assert tiered.counters == {"hot_rows": reads * hot_read, "cold_rows": reads * cold_read}


def test_the_gpu_tier_is_uploaded_before_any_stream_reads_it(monkeypatch):
    """Bug: the slot map, hot rows and counters were copied asynchronously on CuPy's current
    stream, and a first lookup on another stream could read them half copied. Every copy is
    made on one stream, which is waited for before the table can be used."""
    from contextlib import nullcontext
    from types import SimpleNamespace

    from ngram_cupy.tables.storage import tiered
    from ngram_cupy.tables.storage.cpu import CpuStorage

    log = []

    class Stream:
        def __enter__(self):
            log.append("enter")

        def __exit__(self, *exc):
            log.append("exit")

        def synchronize(self):
            log.append("synchronize")

    cupy = SimpleNamespace(asarray=lambda array: log.append(f"copy {array.dtype}") or array)
    monkeypatch.setattr(tiered, "cupy_module", lambda: cupy)
    monkeypatch.setattr(tiered, "cuda_stream", Stream)
    cold = CpuStorage(np.zeros((100, 4), np.float32).view(np.uint32), formats.FORMATS[0])
    cold.device_view = SimpleNamespace(device=nullcontext())  # as if the GPU read it
    storage = tiered.TieredStorage(cold, np.array([3, 50]))
    assert log == ["enter", "copy uint64", "copy uint32", "copy uint32", "copy uint64", "exit",
                   "synchronize"]
    np.testing.assert_array_equal(storage.device_hot, storage.host_hot)
    assert storage.device_tier.map[0] is storage.device_map[0]


@pytest.mark.gpu
def test_a_first_lookup_on_another_stream_reads_a_whole_new_tier():
    """On a device: a 64 MiB hot tier, then at once a lookup on a fresh non-blocking stream
    (nothing orders it after the copies but the upload's wait)."""
    import cupy

    rng = np.random.default_rng(22)
    weight = random_bits(rng, 1 << 17, 256, np.float32)  # 128 MiB of rows, half of them hot
    hot = np.arange(0, 1 << 17, 2)
    tiered, plain = tiered_and_plain(weight, hot)
    ids = rng.integers(0, 1 << 17, (4096, 4))
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:  # the ids copied on the lookup's stream: only the tier is in question
        device_ids = cupy.asarray(ids)
    got = tiered.lookup(device_ids, stream=stream)
    stream.synchronize()
    np.testing.assert_array_equal(cupy.asnumpy(got).view(np.uint32),
                                  plain.lookup(ids).view(np.uint32))
    assert tiered.counters["hot_rows"] == int((ids % 2 == 0).sum())


class TierStream:
    """A CuPy-like stream: records its waits, and whether it is capturing a graph."""

    def __init__(self, log, name, ptr, capturing=False):
        self.log, self.name, self.ptr, self.capturing = log, name, ptr, capturing

    def synchronize(self):
        self.log.append(f"synchronize {self.name}")

    def is_capturing(self):
        return self.capturing


def test_gpu_counters_wait_for_the_tables_streams_only(monkeypatch):
    """Reading the GPU's counters waits for the streams that looked the table up (never the
    whole device: that breaks a global-mode graph capture elsewhere) and refuses while one of
    them is capturing a graph."""
    from ngram_cupy.tables.storage import tiered

    log = []
    table = nc.EmbeddingTable(np.zeros((100, 4), np.float32), placement="pinned",
                              hot_rows=[1, 2])
    table.lookup(np.array([[1, 5, 2]]))  # host counts: 2 hot, 1 cold
    storage = table.storage
    storage.device_counts = "device counters"
    monkeypatch.setattr(tiered, "read_counts", lambda counts: log.append(f"read {counts}")
                        or np.array([30, 40], np.uint64))
    monkeypatch.setattr(tiered, "cupy_module", lambda: pytest.fail("a device-wide call"))
    caller, side = TierStream(log, "caller", 1, capturing=True), TierStream(log, "side", 2)
    for stream in (caller, side, caller):  # what lookups and the fused kernel report
        storage.used_on(stream)
    with pytest.raises(RuntimeError, match="capturing a CUDA graph: read them after"):
        _ = table.counters
    assert log == []
    caller.capturing = False
    assert table.counters == {"hot_rows": 32, "cold_rows": 41}
    assert log == ["synchronize caller", "synchronize side", "read device counters"]
    assert table.counters == {"hot_rows": 32, "cold_rows": 41}  # nothing ran since: no wait
    assert log[3:] == ["read device counters"]
    monkeypatch.setattr(gather_cupy, "gather_rows", lambda *args, **kwargs: None)
    storage.gather(Gather(DEVICE, None, None, 0, 0, np.float32(1), stream=side))  # a lookup
    _ = table.counters
    assert log[4:] == ["synchronize side", "read device counters"]


@pytest.mark.parametrize("hot_rows, error, match", [
    ([5, 3], ValueError, "hot_rows must be sorted and unique"),
    ([10], ValueError, r"hot_rows must lie within the table's rows \[0, 10\), got 10"),
    ([-1, 2], ValueError, "got -1"),
    (np.array([0.5]), TypeError, "hot_rows must hold integer"),
])
def test_bad_hot_rows_are_refused(hot_rows, error, match):
    with pytest.raises(error, match=match):
        nc.EmbeddingTable(np.zeros((10, 4), np.float32), placement="pinned", hot_rows=hot_rows)


def test_hot_rows_need_host_rows(tmp_path):
    layout = nc.layer_layout(TINY, 0)
    weight = np.random.default_rng(0).standard_normal((layout.padded_rows, layout.head_dim))
    weight = weight.astype(np.float16)
    nc.save_ngram_embedding(tmp_path / "model", layout, weight)
    with pytest.raises(ValueError, match="hot_rows need placement 'pinned' or 'cpu'"):
        nc.load_ngram_embedding(tmp_path / "model", TINY, 0, placement="mmap", hot_rows=[1])
    hot = np.array([0, 3, 21, 22, 40, 63])
    ids = np.arange(64).reshape(16, 4)
    parts = []
    for rank, kept in enumerate([3, 2, 1]):  # rows [0, 22), [22, 44), [44, 64)
        table = nc.load_ngram_embedding(tmp_path / "model", TINY, 0, placement="pinned",
                                        rank=rank, world_size=3, hot_rows=hot).table
        parts.append(table.lookup(ids, out_dtype=np.float32))
        assert table.counters["hot_rows"] == kept  # each of the 64 ids once
    np.testing.assert_array_equal(np.sum(parts, axis=0),
                                  reference_lookup(weight, ids, 1.0, np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, out_dtype", PAIRS, ids=str)
def test_gpu_tiered_lookup_equals_the_cpu_one(dtype, out_dtype):
    """On a device: the GPU tier (one launch) gives the CPU table's bytes and the same counts."""
    import cupy

    rng = np.random.default_rng(15)
    weight = random_bits(rng, 4096, 160 // formats.storage_format(dtype).itemsize, dtype)
    hot = np.unique(rng.integers(0, 4096, 1000))
    tiered, plain = tiered_and_plain(weight, hot, scale=0.5)
    assert tiered.pinned and tiered.storage.device_hot is not None
    ids = adversarial_ids(rng, hot, 0, 4096, (512, 16))
    got = tiered.lookup(cupy.asarray(ids), out_dtype=out_dtype)
    want = plain.lookup(ids, out_dtype=out_dtype)
    np.testing.assert_array_equal(cupy.asnumpy(got).view(f"u{want.itemsize}"),
                                  want.view(f"u{want.itemsize}"))
    hot_read, cold_read = expected_counts(ids, hot, 0, 4096)
    assert tiered.counters == {"hot_rows": hot_read, "cold_rows": cold_read}
    tiered.prefetch(cupy.asarray(ids), out_dtype=out_dtype)  # else the lookup discards it
    again = tiered.lookup(cupy.asarray(ids), out_dtype=out_dtype)
    np.testing.assert_array_equal(cupy.asnumpy(again), cupy.asnumpy(got))
    assert tiered.counters == {"hot_rows": 2 * hot_read, "cold_rows": 2 * cold_read}



@pytest.mark.gpu
@pytest.mark.parametrize("dtype, out_dtype", PAIRS, ids=str)
def test_gpu_fused_tier_equals_the_untiered_lookup(dtype, out_dtype):
    """On a device: the tiered fused kernel (one launch) gives the untiered table's bytes, ids
    included, and counts each row read in its tier, on a whole table and on a row shard."""
    import cupy

    config = nc.NGramConfig(vocab_size=5000, ngram_size=3, heads_per_ngram=8,
                            ngram_vocab_size_base=2000, eos_token_id=7,
                            embedding_dim=16 * 160 // formats.storage_format(dtype).itemsize)
    layout = nc.layer_layout(config, 0)
    rng = np.random.default_rng(16)
    weight = random_bits(rng, layout.padded_rows, layout.head_dim, dtype)
    num_tokens = 700
    tokens = rng.integers(0, 5000, num_tokens)
    tokens[::5] = 7
    starts = np.array([0, 1, 300, 300, num_tokens])
    context = rng.integers(0, 5000, (4, 2))
    ids = reference.compute_ngram_ids(layout, tokens, starts, context)
    plain = nc.NGramEmbedding(layout, nc.EmbeddingTable(weight, scale=0.5))
    want = plain(tokens, starts, context, out_dtype=out_dtype)
    bits = f"u{want.itemsize}"
    for start, stop in [(0, layout.padded_rows), (1000, 20_000)]:
        hot = np.unique(np.concatenate([ids[(ids >= start) & (ids < stop)][::3],
                                        rng.integers(start, stop, 500)]))
        table = nc.EmbeddingTable(weight[start:stop], scale=0.5, placement="pinned",
                                  row_start=start, total_rows=layout.padded_rows,
                                  hot_rows=hot)
        fused = nc.NGramEmbedding(layout, table, fused=True)
        ids_out = cupy.full(ids.shape, -1, cupy.int64)
        got = cupy.asnumpy(fused(cupy.asarray(tokens), cupy.asarray(starts),
                                 cupy.asarray(context), out_dtype=out_dtype, ids_out=ids_out))
        np.testing.assert_array_equal(ids_out.get(), ids)
        inside = np.repeat((ids >= start) & (ids < stop), layout.head_dim, axis=1)
        np.testing.assert_array_equal(got.view(bits)[inside], want.view(bits)[inside])
        assert not got.view(bits)[~inside].any()
        hot_read, cold_read = expected_counts(ids, hot, start, stop - start)
        assert table.counters == {"hot_rows": hot_read, "cold_rows": cold_read}
