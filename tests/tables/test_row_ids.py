"""Ids outside the whole table are an IndexError naming the first one, on every path; ids of other
shards (inside ``[0, total_rows)``) still give zero rows.

Every placement and format through ``EmbeddingTable``, the Numba gather's blocks, the host-built
``gather.cu`` (plain, tiered, block-scaled) and the simulated fused kernels (plain, tiered).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import simulator
from mapped_table import MappedTable

import ngram_cupy as nc
from ngram_cupy.formats import BFLOAT16, FLOAT8_E4M3, FLOAT32, NVFP4
from ngram_cupy.ids import fused_cuda, ids_cuda
from ngram_cupy.tables import gather_cupy
from ngram_cupy.tables.gather_numba import gather_rows
from ngram_cupy.tables.hot_rows import build_map
from ngram_cupy.tables.row_ids import NO_BAD_WORD, check_row_ids, first_bad

ROW_START, ROWS, TOTAL, HEAD_DIM = 8, 12, 40, 32
# Refused: the whole table's end, below it, past int32, the int64 maximum.
BAD_IDS = (TOTAL, -1, 2**31, 2**63 - 1)
# Served as zero rows: the rows just outside the shard (other ranks own them).
OTHER_SHARDS = (ROW_START - 1, ROW_START + ROWS)
FORMAT_NAMES = ("float32", "bfloat16", "float8_e4m3fn", "nvfp4", "mxfp8")
PLACEMENTS = ("cpu", "pinned", "tiered", "mmap", "shared")


def table_arrays(name: str, rng) -> dict:
    """Random rows of a format as ``EmbeddingTable`` keyword arguments (weight first)."""
    if name == "nvfp4":
        return {"weight": rng.integers(0, 256, (ROWS, HEAD_DIM // 2), dtype=np.uint8),
                "block_scales": rng.integers(0, 0x7F, (ROWS, HEAD_DIM // 16), dtype=np.uint8),
                "dtype": "nvfp4", "scale": 0.5}
    if name == "mxfp8":
        weight = rng.integers(0, 0x7F, (ROWS, HEAD_DIM), dtype=np.uint8)
        return {"weight": weight.view(ml_dtypes.float8_e4m3fn), "dtype": "mxfp8",
                "block_scales": rng.integers(120, 134, (ROWS, HEAD_DIM // 32), dtype=np.uint8)}
    values = rng.standard_normal((ROWS, HEAD_DIM)).astype(np.float32)
    return {"weight": values.astype(getattr(ml_dtypes, name, np.float32))}


def make_table(placement: str, arrays: dict) -> nc.EmbeddingTable:
    """The rows as global rows ``[ROW_START, +ROWS)`` of a ``TOTAL``-row table, placed."""
    geometry = {"row_start": ROW_START, "total_rows": TOTAL}
    if placement == "mmap":
        weight, scales = arrays["weight"], arrays.get("block_scales")
        half = ROWS // 2
        blocks = [(ROW_START, weight[:half]), (ROW_START + half, weight[half:])]
        if scales is not None:
            blocks = [(*blocks[0], scales[:half]), (*blocks[1], scales[half:])]
        return MappedTable(blocks, HEAD_DIM, arrays.get("dtype", weight.dtype),
                           arrays.get("scale"), ROW_START, ROW_START + ROWS, TOTAL)
    if placement == "tiered":
        hot = np.arange(ROW_START, ROW_START + ROWS, 3)
        return nc.EmbeddingTable(**arrays, placement="pinned", hot_rows=hot, **geometry)
    return nc.EmbeddingTable(**arrays, placement=placement, **geometry)


def with_bad(rng, bad_id: int, shape=(3, 4), at: int = 9) -> np.ndarray:
    """int64 ids of the shard and its neighbours, ``bad_id`` at flat ``at`` and again after."""
    ids = rng.integers(ROW_START, ROW_START + ROWS, shape)
    ids.reshape(-1)[:2] = OTHER_SHARDS
    ids.reshape(-1)[at] = bad_id
    ids.reshape(-1)[-1] = TOTAL + 5  # a later bad id: not the one named
    return ids


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_every_placement_refuses_ids_outside_the_table(name, placement, request):
    if placement == "shared":
        if name in ("nvfp4", "mxfp8"):
            pytest.skip("placement='shared' holds no block-scaled tables")
        request.getfixturevalue("shm_dir")
    rng = np.random.default_rng(FORMAT_NAMES.index(name))
    arrays = table_arrays(name, rng)
    table = make_table(placement, arrays)
    reference = make_table("cpu", arrays)
    ids = np.array([[ROW_START, OTHER_SHARDS[0]], [ROW_START + ROWS - 1, OTHER_SHARDS[1]]])
    rows = table.lookup(ids, out_dtype=np.float32).reshape(2, 2, HEAD_DIM)
    assert not rows[:, 1].any()  # other shards: zero rows
    np.testing.assert_array_equal(rows[:, 0], reference.lookup(
        ids[:, :1], out_dtype=np.float32))
    for bad_id in BAD_IDS:
        with pytest.raises(IndexError, match=rf"ids\[2, 1\] = {bad_id} .*\[0, {TOTAL}\).*"
                                             r"position 9\)"):
            table.lookup(with_bad(rng, bad_id))
    table.close()


def test_a_prefetch_of_bad_ids_raises_at_the_lookup():
    table = make_table("cpu", table_arrays("float32", np.random.default_rng(0)))
    ids = np.array([[ROW_START, -1]])
    table.prefetch(ids)
    with pytest.raises(IndexError, match=r"ids\[0, 1\] = -1"):
        table.lookup(ids)
    assert table.lookup(np.array([[ROW_START, ROW_START - 1]])).shape == (1, 2 * HEAD_DIM)


def test_a_refused_prefetch_says_so_at_a_lookup_of_other_ids():
    """The worker's IndexError surfaces at the next call whatever ids it passes: it names the
    prefetch and the prefetch's id, not one the lookup passed (issue 43)."""
    table = make_table("cpu", table_arrays("float32", np.random.default_rng(0)))
    table.prefetch(np.array([[ROW_START, TOTAL + 3], [ROW_START, ROW_START]]))
    with pytest.raises(IndexError, match=r"^the earlier prefetch of ids of shape \(2, 2\), joined "
                                         rf"by this call: ids\[0, 1\] = {TOTAL + 3} is outside"):
        table.lookup(np.array([[ROW_START + 1, ROW_START + 2]]))
    assert table.lookup(np.array([[ROW_START + 1, ROW_START + 2]])).shape == (1, 2 * HEAD_DIM)
    table.close()


def test_every_path_words_a_bad_id_alike_and_speaks_of_shards_only_when_sharded():
    """The lookup, the pass of check_row_ids, a backward and an optimizer step give one wording
    (row_ids.row_id_error); shards appear only for a sharded table (issue 43)."""
    weight = np.ones((TOTAL, 4), np.float32)
    ids = np.array([[1, 2], [TOTAL, 3]])
    whole = nc.EmbeddingTable(weight)
    want = (f"ids[1, 0] = {TOTAL} is outside the table's rows [0, {TOTAL}) (the first such id, "
            "at flat position 2)")
    for call in (lambda: whole.lookup(ids), lambda: check_row_ids(ids, TOTAL),
                 lambda: nc.embedding_backward(ids, np.ones((2, 8), np.float32), TOTAL),
                 lambda: nc.RowwiseAdagrad(whole, 0.1).step_from_output_grad(
                     ids, np.ones((2, 8), np.float32))):
        with pytest.raises(IndexError) as caught:
            call()
        assert str(caught.value) == want
    shard = nc.EmbeddingTable(weight[:ROWS], row_start=ROW_START, total_rows=TOTAL)
    with pytest.raises(IndexError) as caught:
        shard.lookup(ids)
    assert str(caught.value) == (want + f"; this shard holds rows [{ROW_START}, "
                                 f"{ROW_START + ROWS}), and ids of other shards give zero rows")
    with pytest.raises(IndexError) as caught:
        nc.RowwiseAdagrad(shard, 0.1).step_from_output_grad(ids, np.ones((2, 8), np.float32))
    assert str(caught.value) == (f"ids[0, 0] = 1 is outside this shard's rows [{ROW_START}, "
                                 f"{ROW_START + ROWS}) of the table's [0, {TOTAL}) (the first "
                                 "such id, at flat position 0)")


@pytest.mark.parametrize("parallel", [False, True])
def test_the_numba_gather_names_the_first_bad_id_across_blocks(parallel):
    """Blocks of 64 tokens each note their first; the earliest block's is named; int32 ids
    (fp8 -> bf16, the kernels other tests compile too)."""
    rows = np.arange(1, ROWS * 4 + 1, dtype=np.uint8).reshape(ROWS, 4)
    ids = np.full((300, 2), ROW_START, np.int32)
    ids[250, 1], ids[140, 0], ids[141, 1] = -7, TOTAL, ROW_START - 1
    out = np.full((300, 8), 7, np.uint16)
    with pytest.raises(IndexError, match=rf"ids\[140, 0\] = {TOTAL} .*position 280\)"):
        gather_rows(rows, FLOAT8_E4M3, ROW_START, 1.0, ids, out, BFLOAT16, parallel=parallel,
                    total_rows=TOTAL)
    assert not out[140, :4].any() and not out[141, 4:].any() and not out[250, 4:].any()
    assert out[0].all()
    gather_rows(rows, FLOAT8_E4M3, ROW_START, 1.0, ids, out, BFLOAT16,
                parallel=parallel)  # without total_rows: unchecked, zero rows


def host_plan_bad(host_gather, table, code, ids, out_code, **kwargs) -> int:
    """The bad word after running the host-built plan (with ``TOTAL`` rows)."""
    bad = np.full(1, NO_BAD_WORD, np.uint64)
    out = np.full((ids.shape[0], ids.shape[1] * HEAD_DIM), 0xAB, np.uint16)
    plan = gather_cupy.launch_plan(table, code, ROW_START, 0.5, ids, out, out_code,
                                   total_rows=TOTAL, bad=bad, **kwargs)
    host_gather.run(plan)
    for position in np.flatnonzero((ids.reshape(-1) < ROW_START)
                                   | (ids.reshape(-1) >= ROW_START + ROWS)):
        assert not out.reshape(ids.size, HEAD_DIM)[position].any()
    return first_bad(bad)


@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
def test_host_built_gathers_note_the_first_bad_position(host_gather, id_dtype):
    """Plain bf16 rows, NVFP4 rows with scales, and a tiered gather: the word holds the first
    bad position (several threads of a row and later bad ids do not change it)."""
    rng = np.random.default_rng(3)
    nvfp4 = table_arrays("nvfp4", rng)
    bf16 = rng.integers(0, 1 << 16, (ROWS, HEAD_DIM)).astype(np.uint16)
    hot = np.arange(0, ROWS, 2)
    tiered = {"hot": (build_map(hot, 0, ROWS), bf16[hot]),
              "counts": np.zeros((gather_cupy.COUNTER_LANES, 2), np.uint64)}
    cases = [(bf16, BFLOAT16, {}), (nvfp4["weight"], NVFP4, {"scales": nvfp4["block_scales"]}),
             (bf16, BFLOAT16, tiered)]
    for bad_id in [i for i in BAD_IDS if np.iinfo(id_dtype).min <= i <= np.iinfo(id_dtype).max]:
        ids = with_bad(rng, bad_id).astype(id_dtype)
        for table, code, kwargs in cases:
            assert host_plan_bad(host_gather, table, code, ids, BFLOAT16, **kwargs) == 9
    ids = with_bad(rng, ROW_START)[:, :-1].astype(id_dtype)  # only other shards' ids
    for table, code, kwargs in cases:
        assert host_plan_bad(host_gather, table, code, ids, BFLOAT16, **kwargs) == -1


@pytest.mark.parametrize("tiered", [False, True])
def test_simulated_fused_kernels_note_the_first_bad_position(simulate, tiered):
    """Ids hashed beyond a table that is too small for the layout (and a row shard of it)."""
    rng = np.random.default_rng(4)
    layout = simulator.layouts()[1]
    total = layout.padded_rows // 2
    start, rows = total // 4, 24
    weight = rng.standard_normal((rows, 4)).astype(np.float32).view(np.uint32)
    tokens, starts, context = simulator.wild_batch(rng, layout, 8, 2)
    ids = nc.compute_ngram_ids(layout, tokens, starts, context)
    want = np.flatnonzero(ids.reshape(-1) >= total)
    assert want.size, "the batch must hash some ids beyond the table"
    out = np.full((8, layout.num_heads * 4), 0xAB, np.uint32)
    bad = np.full(1, NO_BAD_WORD, np.uint64)
    extra = {}
    if tiered:
        hot = np.arange(0, rows, 3)
        extra = {"hot": (build_map(hot, 0, rows), weight[hot]),
                 "counts": np.zeros((gather_cupy.COUNTER_LANES, 2), np.uint64)}
    fused_cuda.launch_fused(layout, tokens, starts, context, ids_cuda.layout_params(layout),
                            weight, FLOAT32, start, 1.0, False, np.zeros((1, 1), np.int64), out,
                            FLOAT32, block=4, total_rows=total, bad=bad, **extra)
    assert first_bad(bad) == want[0]
    owned = (ids >= start) & (ids < start + rows)
    assert not out.reshape(8, layout.num_heads, 4)[~owned].any()


def test_check_row_ids_is_the_same_check_as_a_pass():
    check_row_ids(np.array([0, 5, TOTAL - 1]), TOTAL)
    with pytest.raises(IndexError, match=r"grads_ids\[1, 0\] = -3"):
        check_row_ids(np.array([[1, 2], [-3, TOTAL]]), TOTAL, "grads_ids")

