"""quantize_table: fp8, NVFP4 and MXFP8 codes that the library's gathers and vLLM 0.33's decode
arithmetic (plain NumPy below) read back bit for bit, within each format's half-step."""

from __future__ import annotations

import json

import engram_cases
import ml_dtypes
import numpy as np
import pytest

import ngram_cupy as nc
from ngram_cupy.cli.main import main
from ngram_cupy.codecs.quantize_cupy import ArrayEngine

BF16, E4M3, E8M0 = ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e8m0fnu
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
ROWS, HEAD_DIM = 203, 64


def source_rows(dtype=BF16) -> np.ndarray:
    """Random rows of very different magnitudes, a zero row and a zero block among them."""
    rng = np.random.default_rng(7)
    rows = rng.standard_normal((ROWS, HEAD_DIM)) * np.exp(rng.uniform(-6, 4, (ROWS, 1)))
    rows[5] = 0
    rows[9, 16:48] = 0
    return rows.astype(dtype)


def vllm_decode(q: nc.QuantizedTable, out_dtype) -> np.ndarray:
    """vLLM 0.33's dequantisation, written out: fp8 ``rows.to(dt) * scale.to(dt)``; NVFP4
    ``(e2m1 * block) * global`` in float32; MXFP8 ``e4m3 * 2**(byte - 127)`` in float32; each
    rounded to nearest even to ``out_dtype``."""
    if q.format.name == "float8_e4m3fn":
        rows = q.weight.astype(np.float32).astype(out_dtype).astype(np.float32)
        scale = np.float32(np.float32(q.scale).astype(out_dtype))
        return (rows * scale).astype(out_dtype)
    if q.format.name == "nvfp4":
        codes = np.stack([q.weight & 0xF, q.weight >> 4], axis=-1).reshape(ROWS, -1)
        blocks = np.repeat(q.block_scales.astype(np.float32), 16, axis=1)
        return ((E2M1[codes] * blocks) * np.float32(q.scale)).astype(out_dtype)
    powers = (q.block_scales.view(np.uint8).astype(np.uint32) << 23).view(np.float32)
    return (q.weight.astype(np.float32) * np.repeat(powers, 32, axis=1)).astype(out_dtype)


def half_steps(q: nc.QuantizedTable, source: np.ndarray) -> np.ndarray:
    """Half the gap of the format's grid around each source value, in the value's units."""
    x = np.abs(source.astype(np.float64))
    if q.format.name == "nvfp4":
        unit = np.repeat(q.block_scales.astype(np.float64), 16, axis=1) * float(q.scale)
        scaled = x / unit
        half = np.select([scaled < 2, scaled < 4], [0.25, 0.5], 1.0)
        return half * unit
    if q.format.name == "mxfp8":
        unit = np.repeat(2.0 ** (q.block_scales.view(np.uint8).astype(np.float64) - 127), 32,
                         axis=1)
    else:
        unit = np.full(x.shape, float(q.scale))
    scaled = np.maximum(x / unit, 2.0**-6)  # E4M3: 3 mantissa bits, subnormals 2**-9 apart
    return 2.0 ** (np.floor(np.log2(scaled)) - 4) * unit


@pytest.mark.parametrize("to", ["fp8", "nvfp4", "mxfp8"])
def test_round_trip_bitwise_and_within_half_a_step(to):
    source = source_rows()
    q = nc.quantize_table(source, to, chunk_rows=50)
    table = nc.EmbeddingTable(q)
    ids = np.arange(ROWS).reshape(-1, 1)
    for out_dtype in (BF16, np.float32):
        want = vllm_decode(q, out_dtype)
        got = table.lookup(ids, out_dtype=out_dtype)
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), out_dtype
    decoded = table.lookup(ids, out_dtype=np.float32).astype(np.float64)
    if to == "fp8":  # float32 output: the scale is not rounded first
        assert np.array_equal(decoded, q.weight.astype(np.float32) * np.float32(q.scale))
    error = np.abs(decoded - source.astype(np.float64))
    assert np.all(error <= half_steps(q, source) * (1 + 2.0**-12))
    relative = np.sqrt(np.mean(error**2)) / np.sqrt(np.mean(source.astype(np.float64) ** 2))
    print(f"{to}: max abs error {error.max():.3g}, relative RMS error {relative:.3g}")
    assert relative < {"fp8": 0.04, "nvfp4": 0.15, "mxfp8": 0.04}[to]


@pytest.mark.parametrize("to", ["fp8", "nvfp4", "mxfp8"])
def test_array_path_matches_the_cpu_kernels(to):
    """The CuPy path's array code, run by NumPy, gives the Numba kernels' bytes."""
    source = source_rows(np.float16)
    q = nc.quantize_table(source, to)
    engine = ArrayEngine(np)
    out = np.empty(q.weight.shape, np.uint8)
    blocks = None if q.block_scales is None else np.empty(q.block_scales.shape, np.uint8)
    getattr(engine, q.format.encoder)(source.astype(np.float32), q.scale, out, blocks)
    assert np.array_equal(out, q.weight.view(np.uint8))
    if blocks is not None:
        assert np.array_equal(blocks, q.block_scales.view(np.uint8))


def test_e4m3_rounding_is_ml_dtypes():
    """Every float32 in [-448, 448] that matters: ties, subnormals, binade edges."""
    grid = np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float32)
    grid = grid[np.isfinite(grid)]
    grid = np.sort(grid)
    mids = (grid[:-1].astype(np.float64) + grid[1:]) / 2
    values = np.concatenate([grid, mids, np.nextafter(mids, 0), np.nextafter(mids, 1e9),
                             np.random.default_rng(1).uniform(-448, 448, 20000),
                             np.random.default_rng(2).uniform(-0.02, 0.02, 20000)])
    values = np.clip(values.astype(np.float32), -448, 448)
    got = ArrayEngine(np).e4m3(values)
    assert np.array_equal(got, values.astype(E4M3).view(np.uint8))
    fp8 = nc.quantize_table(values.reshape(-1, 1)[: len(values) // 16 * 16], "fp8", scale=1.0)
    assert np.array_equal(fp8.weight.view(np.uint8).ravel(), got[: len(values) // 16 * 16])


def test_e2m1_ties_go_to_the_even_code():
    values = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.5, -0.25, -1.75, 0.26, 0.74],
                      np.float32)
    row = np.zeros((1, 16), np.float32)
    row[0, : len(values)] = values
    row[0, 15] = 6.0  # block amax 6: block scale 1 under global scale 1
    q = nc.quantize_table(row, "nvfp4", scale=1.0)
    assert float(q.block_scales.astype(np.float32)[0, 0]) == 1.0
    codes = np.stack([q.weight & 0xF, q.weight >> 4], axis=-1).ravel()
    assert E2M1[codes[: len(values)]].tolist() == [0, 1, 1, 2, 2, 4, 4, 6, -0.0, -2, 0.5, 0.5]


def test_zero_rules():
    zero = np.zeros((4, 32), BF16)
    fp8, nvfp4, mx = (nc.quantize_table(zero, to) for to in ("fp8", "nvfp4", "mxfp8"))
    assert float(fp8.scale) == 1.0 and float(nvfp4.scale) == 1.0
    assert np.all(nvfp4.block_scales.astype(np.float32) == 1.0)
    assert np.all(mx.block_scales.view(np.uint8) == 127)
    assert not any(np.any(q.weight.view(np.uint8)) for q in (fp8, nvfp4, mx))
    tiny = np.zeros((1, 32), np.float32)
    tiny[0, :16], tiny[0, 16] = 1000.0, 1e-6  # a block far below the table's amax
    q = nc.quantize_table(tiny, "nvfp4")
    assert q.block_scales.view(np.uint8)[0, 1] == 1  # the smallest E4M3 scale, never zero


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_rows_are_refused_naming_the_row(bad):
    source = source_rows(np.float32)
    source[117, 3] = bad
    for to in ("fp8", "nvfp4", "mxfp8"):
        with pytest.raises(ValueError, match="weight row 117 holds NaN or inf"):
            nc.quantize_table(source, to, chunk_rows=40)
    with pytest.raises(ValueError, match="weight row 117"):
        nc.quantize_table(source, "fp8", scale=1.0)


def test_torch_input_and_given_scale():
    torch = pytest.importorskip("torch")
    source = source_rows()
    from_torch = nc.quantize_table(torch.from_numpy(source.view(np.int16)).view(torch.bfloat16),
                                   "nvfp4", scale=0.01)
    from_numpy = nc.quantize_table(source, "nvfp4", scale=0.01)
    assert float(from_torch.scale) == np.float32(0.01)
    assert np.array_equal(from_torch.weight, from_numpy.weight)
    assert np.array_equal(from_torch.block_scales.view(np.uint8),
                          from_numpy.block_scales.view(np.uint8))


def test_bad_arguments():
    source = source_rows()
    with pytest.raises(ValueError, match="to must be one of fp8, nvfp4, mxfp8"):
        nc.quantize_table(source, "int4")
    with pytest.raises(ValueError, match="block for nvfp4 must be 16"):
        nc.quantize_table(source, "nvfp4", block=32)
    with pytest.raises(ValueError, match="block for float8_e4m3fn must be None"):
        nc.quantize_table(source, "fp8", block=16)
    with pytest.raises(ValueError, match="mxfp8 takes no scale"):
        nc.quantize_table(source, "mxfp8", scale=1.0)
    with pytest.raises(ValueError, match="scale must be a finite positive"):
        nc.quantize_table(source, "fp8", scale=-1.0)
    with pytest.raises(TypeError, match="weight must be float32, float16 or bfloat16"):
        nc.quantize_table(source.astype(E4M3), "fp8")
    with pytest.raises(ValueError, match="weight must be 2-D"):
        nc.quantize_table(source.ravel(), "fp8")
    with pytest.raises(ValueError, match="multiple of 32"):
        nc.quantize_table(source[:, :48], "mxfp8")
    with pytest.raises(ValueError, match="brings its own scale"):
        nc.EmbeddingTable(nc.quantize_table(source, "fp8"), scale=1.0)


def test_quantize_command_engram(tmp_path):
    """An Engram model's float tables to MXFP8 in DeepSeek's names, read back by
    load_engram_embedding: the bytes quantize_table gives."""
    tokens = engram_cases.token_map(np.random.default_rng(3), 200, 66)
    layout = nc.engram_layout(nc.EngramConfig([4, 9], 3, 2, 32, 7, [2_000, 2_000], tokens.size,
                                              0), tokens)
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"text_config": layout.config.to_hf()}))
    rng = np.random.default_rng(4)
    weights = [rng.standard_normal((rows, layout.head_dim)).astype(BF16)
               for rows in layout.rows_per_layer]
    nc.save_engram_embedding(folder, layout, weights)
    out = tmp_path / "mx"
    assert main(["quantize", str(folder), "--to", "mxfp8", "--scheme", "engram", str(out),
                 "--quiet"]) == 0
    embedding = nc.load_engram_embedding(out, layout)
    for weight, table in zip(weights, embedding.tables, strict=True):
        want = nc.quantize_table(weight, "mxfp8")  # the table owns its heads' rows
        rows = slice(table.row_start, table.row_start + table.num_rows)
        assert table.format.name == "mxfp8" and table.num_rows > 0
        assert np.array_equal(table.host_view.view(np.uint8), want.weight.view(np.uint8)[rows])
        assert np.array_equal(table.host_scales, want.block_scales.view(np.uint8)[rows])
    assert main(["quantize", str(folder), "--to", "fp8", "--scheme", "engram",
                 str(tmp_path / "fp8"), "--quiet"]) == 2
    assert not (tmp_path / "fp8").exists()


@pytest.mark.gpu
@pytest.mark.parametrize("to", ["fp8", "nvfp4", "mxfp8"])
def test_gpu_path_gives_the_cpu_bytes(to):
    """CuPy tables are quantised on their GPU into the CPU kernels' bytes."""
    import cupy

    source = source_rows()
    want = nc.quantize_table(source, to, chunk_rows=64)
    got = nc.quantize_table(cupy.asarray(source.astype(np.float32)), to, chunk_rows=64)
    assert float(got.scale or 0) == float(want.scale or 0)
    assert np.array_equal(cupy.asnumpy(got.weight), want.weight.view(np.uint8))
    if want.block_scales is not None:
        assert np.array_equal(cupy.asnumpy(got.block_scales), want.block_scales.view(np.uint8))
    table = nc.EmbeddingTable(got, placement="gpu")
    ids = cupy.arange(ROWS).reshape(-1, 1)
    assert np.array_equal(cupy.asnumpy(table.lookup(ids)).view(np.uint16),
                          vllm_decode(want, BF16).view(np.uint16))


# --- issue 43: the second hour ------------------------------------------------------------


@pytest.mark.parametrize("to", ["fp8", "float8_e4m3fn", "F8_E4M3", "nvfp4", "mxfp8"])
def test_quantize_takes_every_name_of_a_format_and_an_embedding_tables_rows(to):
    """Any of a format's names (the one alias table) and an EmbeddingTable's rows: the same
    codes as the plain array under the encoder's name."""
    rows = source_rows(np.float32)
    encoder = {"float8_e4m3fn": "fp8", "F8_E4M3": "fp8"}.get(to, to)
    expected = nc.quantize_table(rows, encoder)
    for weight in (rows, nc.EmbeddingTable(rows.copy())):
        got = nc.quantize_table(weight, to)
        assert got.format is expected.format
        np.testing.assert_array_equal(got.weight.view(np.uint8), expected.weight.view(np.uint8))
        assert got.scale == expected.scale


def test_quantize_refuses_a_shard_a_scaled_or_a_closed_table():
    rows = source_rows(np.float32)
    with pytest.raises(ValueError, match="one shard"):
        nc.quantize_table(nc.EmbeddingTable(rows[:100], row_start=0, total_rows=ROWS), "fp8")
    with pytest.raises(ValueError, match="scale"):
        nc.quantize_table(nc.EmbeddingTable(rows, scale=2.0), "fp8")
    table = nc.EmbeddingTable(rows)
    table.close()
    with pytest.raises(ValueError, match="closed"):
        nc.quantize_table(table, "fp8")


def test_every_format_is_named_by_its_repr_and_label():
    from ngram_cupy.formats import FORMATS, find_format

    for fmt in FORMATS:
        assert repr(fmt) == fmt.name == fmt.label != ""
        assert find_format(repr(fmt)) is fmt
        for alias in fmt.aliases:
            assert find_format(alias) is fmt
    table = nc.EmbeddingTable(np.zeros((8, 32), np.float32))
    assert repr(table.format) == "float32"
    assert nc.EmbeddingTable.empty(8, 32, "fp8", scale=1.0).format.name == "float8_e4m3fn"
