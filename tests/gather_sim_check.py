"""The fused ids + gather kernel in the CUDA simulator, against the CPU path.

Run by tests/test_gather_kernels.py as ``NUMBA_ENABLE_CUDASIM=1 python tests/gather_sim_check.py``;
the last line printed is a JSON object ``{check: "ok" or the error}``. Array accesses of the
simulated kernel are bounds-checked (cuda_sim_check.py patches the simulator's arrays), so a read
outside the table fails. Inputs stay tiny: the simulator runs each GPU thread as a Python thread.
"""

from __future__ import annotations

import os
import sys

import numpy as np

if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
    sys.exit("run with NUMBA_ENABLE_CUDASIM=1")

import cuda_sim_check  # noqa: E402  (bounds-checked FakeCUDAArray, the runner)
from cuda_sim_check import check, layouts, random_batch  # noqa: E402
from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray  # noqa: E402

import ngram_cupy as nc  # noqa: E402
from ngram_cupy import dequant, fused_cuda, ids_cuda  # noqa: E402


def fused(layout, table, tokens, starts, context, out_format, block, write_ids=True):
    """``(rows, ids)`` from the simulated fused kernel."""
    num_tokens = len(tokens)
    out = np.full((num_tokens, layout.num_heads * table.head_dim), 0xAB, out_format.raw)
    ids = np.full((num_tokens if write_ids else 1, layout.num_heads), -1, np.int64)
    raw = table.host_view.view(table.format.raw)
    scale = 1.0 if table.scale is None else table.scale
    fused_cuda.launch_fused(
        layout, FakeCUDAArray(tokens), FakeCUDAArray(starts), FakeCUDAArray(context),
        FakeCUDAArray(ids_cuda.layout_params(layout)),
        FakeCUDAArray(fused_cuda.table_words(raw, table.format.itemsize)), table.format.code,
        table.row_start, scale, write_ids, FakeCUDAArray(ids), FakeCUDAArray(out),
        out_format.code, block=block)
    return out, ids


def cpu(layout, table, tokens, starts, context, out_format):
    """``(rows, ids)`` from the CPU path: ids, then the Numba gather."""
    ids = nc.compute_ngram_ids(layout, tokens, starts, context)
    rows = table.lookup(ids, out_dtype=out_format.dtype)
    return rows.view(out_format.raw), ids


def every_pattern_table(rng, rows, head_dim, fmt):
    """Random bits of the format: NaNs, infinities and subnormals included."""
    bits = rng.integers(0, 1 << (8 * fmt.itemsize), (rows, head_dim), dtype=np.uint64)
    return bits.astype(fmt.raw).view(fmt.dtype)


cuda_sim_check.CHECKS.clear()  # its runner runs only the checks below


@check
def every_format_pair_matches_the_cpu_path():
    """All storage x output formats, a row shard, a partial last block, EOS-heavy tokens."""
    rng = np.random.default_rng(1)
    layout = layouts()[1]
    for fmt in dequant.FORMATS:
        for out_code in dequant.OUTPUT_CODES:
            out_format = dequant.FORMATS[out_code]
            head_dim = 6 if fmt.itemsize < 4 else 3
            full = every_pattern_table(rng, layout.padded_rows, head_dim, fmt)
            start = layout.padded_rows // 3
            table = nc.EmbeddingTable(full[start : start + 80], scale=0.375, row_start=start,
                                      total_rows=layout.padded_rows)
            batch = random_batch(rng, layout, 9, 3)
            got_rows, got_ids = fused(layout, table, *batch, out_format, block=4)
            want_rows, want_ids = cpu(layout, table, *batch, out_format)
            np.testing.assert_array_equal(got_ids, want_ids)
            np.testing.assert_array_equal(got_rows, want_rows, err_msg=f"{fmt.name}->{out_code}")


@check
def whole_tables_without_scale_and_without_ids():
    """Odd head dims (one value per word), int32 inputs, nothing written to ids."""
    rng = np.random.default_rng(2)
    for layout in layouts()[::2]:
        fmt = dequant.FORMATS[dequant.FLOAT8_E4M3]
        full = every_pattern_table(rng, layout.padded_rows, 5, fmt)
        table = nc.EmbeddingTable(full)
        batch = random_batch(rng, layout, 6, 2, dtypes=(np.int32,) * 3)
        out_format = dequant.FORMATS[dequant.BFLOAT16]
        got_rows, got_ids = fused(layout, table, *batch, out_format, block=4, write_ids=False)
        np.testing.assert_array_equal(got_rows, cpu(layout, table, *batch, out_format)[0])
        assert np.all(got_ids == -1)


@check
def empty_batch_launches_nothing():
    layout = layouts()[1]
    table = nc.EmbeddingTable(np.zeros((layout.padded_rows, 4), np.float32))
    tokens = np.zeros(0, np.int64)
    rows, _ = fused(layout, table, tokens, np.zeros(2, np.int64), np.zeros((1, 2), np.int64),
                    dequant.FORMATS[dequant.FLOAT32], block=4)
    assert rows.shape == (0, layout.num_heads * 4)


if __name__ == "__main__":
    sys.exit(cuda_sim_check.main())
