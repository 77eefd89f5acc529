"""Float8 dequantisation rounds like vLLM 0.33 by default (SPEC 10.1): ``rows.to(dtype) *
scale.to(dtype)``, i.e. the scale rounded to the output dtype first, then the product; the
``scale_rounding="float32"`` option keeps one rounding of the float32 product. Checked against
plain ml_dtypes / torch arithmetic on every path: the Numba CPU gather (every host placement),
``gather.cu`` built for the host and the fused kernel in the CUDA simulator."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import simulator
import torch
from mapped_table import MappedTable

import ngram_cupy as nc
from ngram_cupy.formats import FORMATS, OUTPUT_CODES, find_format
from ngram_cupy.ids import fused_cuda, ids_cuda

FP8 = ml_dtypes.float8_e4m3fn
ALL_CODES = np.arange(256, dtype=np.uint8).reshape(16, 16)  # every fp8 byte, 16 rows of 16
IDS = np.arange(16, dtype=np.int64).reshape(4, 4)
OUT_DTYPES = (ml_dtypes.bfloat16, np.float16, np.float32)


def scales() -> list[np.float32]:
    """The SPEC's example, bf16-exact ones, one float16 cannot hold, and random float32 scales
    over many binades."""
    rng = np.random.default_rng(10)
    random = (rng.random(60) * 2.0 ** rng.integers(-20, 12, 60)).astype(np.float32)
    fixed = np.array([1.3883328, 0.5, 0.375, 1.0, 3.0e-3, 1.0e-7, 7.0e4, 1.0 / 3.0], np.float32)
    return list(np.concatenate([fixed, random]))


def vllm_bits(scale, out_dtype) -> np.ndarray:
    """vLLM's ``rows.to(dtype) * weight_scale.to(dtype)`` in plain ml_dtypes arithmetic (an
    operation on two bf16 / f16 values computes in float32 and rounds once), as output bits."""
    out = np.dtype(out_dtype)
    with np.errstate(over="ignore", invalid="ignore"):
        rows = ALL_CODES.view(FP8)[IDS].astype(out) * np.array(scale, np.float32).astype(out)
    return rows.reshape(IDS.shape[0], -1)


def single_rounding(scale, out_dtype) -> np.ndarray:
    """``float32(fp8) * float32(scale)`` rounded once to the output dtype."""
    with np.errstate(over="ignore", invalid="ignore"):
        rows = ALL_CODES.view(FP8)[IDS].astype(np.float32) * np.float32(scale)
        return rows.astype(out_dtype).reshape(IDS.shape[0], -1)


def assert_same_values(got, want, message=""):
    """Equal bits, every NaN compared as a class (payloads and signs differ by platform)."""
    got, want = np.asarray(got), np.asarray(want)
    nan = np.isnan(want.astype(np.float32))
    np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan, err_msg=message)
    raw = find_format(want.dtype).raw
    np.testing.assert_array_equal(got.view(raw)[~nan], want.view(raw)[~nan], err_msg=message)


def test_the_spec_example():
    """fp8 byte 0x65 (52.0) times 1.3883328: vLLM's bf16 is 0x4291, one rounding gives 0x4290."""
    weight = np.array([[0x65]], np.uint8).view(FP8)
    ids = np.zeros((1, 1), np.int64)
    table = nc.EmbeddingTable(weight, scale=1.3883328)
    assert table.scale_rounding == "output"
    assert table.lookup(ids).view(np.uint16)[0, 0] == 0x4291
    single = nc.EmbeddingTable(weight, scale=1.3883328, scale_rounding="float32")
    assert single.lookup(ids).view(np.uint16)[0, 0] == 0x4290


def test_the_ml_dtypes_reference_is_torchs_arithmetic():
    """The plain reference above is vLLM's torch expression, bit for bit."""
    for scale in scales()[:20]:
        rows = torch.from_numpy(ALL_CODES[IDS].reshape(4, -1)).view(torch.float8_e4m3fn)
        for out_dtype, torch_dtype in zip(OUT_DTYPES, (torch.bfloat16, torch.float16,
                                                       torch.float32), strict=True):
            want = rows.to(torch_dtype) * torch.tensor(scale).to(torch_dtype)
            got = vllm_bits(scale, out_dtype)
            assert_same_values(got, want.float().numpy().astype(out_dtype), f"{scale!r}")


@pytest.mark.parametrize("placement", ["cpu", "pinned", "mmap"])
def test_every_fp8_code_and_scale_on_the_cpu(placement):
    for scale in scales():
        for rounding, reference in (("output", vllm_bits), ("float32", single_rounding)):
            if placement == "mmap":
                table = MappedTable([(0, ALL_CODES.view(FP8))], 16, FP8, scale, 0, 16, 16,
                                    scale_rounding=rounding)
            else:
                table = nc.EmbeddingTable.empty(16, 16, "float8_e4m3fn", placement=placement,
                                                scale=scale, scale_rounding=rounding)
                table.write_rows(0, ALL_CODES)
            for out_dtype in OUT_DTYPES:
                assert_same_values(table.lookup(IDS, out_dtype=out_dtype),
                                   reference(scale, out_dtype),
                                   f"{placement}, {rounding}, scale {scale!r}, {out_dtype}")


def test_the_two_roundings_differ_where_the_spec_says():
    """With a non-bf16 scale a good share of bf16 values differ in the last bit; never with a
    bf16 scale."""
    differ = np.mean(vllm_bits(np.float32(1.3883328), ml_dtypes.bfloat16).view(np.uint16)
                     != single_rounding(np.float32(1.3883328), ml_dtypes.bfloat16).view(np.uint16))
    assert differ > 0.05
    exact = np.float32(ml_dtypes.bfloat16(1.3883328))
    np.testing.assert_array_equal(vllm_bits(exact, ml_dtypes.bfloat16).view(np.uint16),
                                  single_rounding(exact, ml_dtypes.bfloat16).view(np.uint16))


def test_host_built_cuda_gather_rounds_like_the_table(host_gather):
    """gather.cu gets the table's ``lookup_scale``: the same bits as vLLM on the host build."""
    for scale in scales()[::3]:
        for rounding, reference in (("output", vllm_bits), ("float32", single_rounding)):
            table = nc.EmbeddingTable(ALL_CODES.view(FP8), scale=scale, scale_rounding=rounding)
            for out_code in OUTPUT_CODES:
                fmt = FORMATS[out_code]
                out = np.zeros((4, 64), fmt.raw)
                host_gather.gather(ALL_CODES, 3, 0, table.lookup_scale(fmt), IDS, out, out_code)
                assert_same_values(out.view(fmt.dtype), reference(scale, fmt.dtype),
                                   f"{rounding}, {scale!r}, {fmt.name}")


def test_simulated_fused_kernel_rounds_like_the_table(simulate):
    """The fused kernel with the scale ``NGramEmbedding`` passes it (``lookup_scale``)."""
    layout = simulator.layouts()[0]
    rng = np.random.default_rng(3)
    weight = rng.integers(0, 256, (layout.padded_rows, 16), dtype=np.uint8)
    batch = simulator.wild_batch(rng, layout, 5, 2)
    ids = nc.compute_ngram_ids(layout, *batch)
    for rounding in ("output", "float32"):
        table = nc.EmbeddingTable(weight.view(FP8), scale=1.3883328, scale_rounding=rounding)
        for out_code in OUTPUT_CODES:
            fmt = FORMATS[out_code]
            out = np.zeros((5, layout.num_heads * 16), fmt.raw)
            fused_cuda.launch_fused(layout, *batch, ids_cuda.layout_params(layout),
                                    fused_cuda.table_words(weight, 1), 3, 0,
                                    table.lookup_scale(fmt), False, np.zeros((1, 1), np.int64),
                                    out, out_code, block=4)
            assert_same_values(out.view(fmt.dtype), table.lookup(ids, out_dtype=fmt.dtype))


def test_the_module_and_loader_take_the_option(tmp_path):
    config = nc.NGramConfig(50, 2, 1, 3, 0, embedding_dim=16, ple_embedding_dtype="float8_e4m3fn")
    from ngram_cupy.torch import NGramEmbeddingModule

    module = NGramEmbeddingModule(config, 0, placement="cpu", scale_rounding="float32")
    assert module.table.scale_rounding == "float32"
    layout = nc.layer_layout(config, 0)
    weight = np.full((layout.padded_rows, layout.head_dim), 0x65, np.uint8).view(FP8)
    nc.save_ngram_embedding(tmp_path, config, 0, weight, scale=np.float32(1.3883328))
    ids = np.zeros((1, 1), np.int64)
    for rounding, bits in (("output", 0x4291), ("float32", 0x4290)):
        embedding = nc.load_ngram_embedding(tmp_path, config, 0, scale_rounding=rounding)
        assert embedding.table.lookup(ids).view(np.uint16)[0, 0] == bits


@pytest.mark.parametrize("bad", ["bf16", None, "Output", 1])
def test_a_bad_option_is_refused(bad):
    with pytest.raises(ValueError, match="scale_rounding"):
        nc.EmbeddingTable(np.zeros((2, 2), FP8), scale=1.0, scale_rounding=bad)
    with pytest.raises(ValueError, match="scale_rounding"):
        nc.EmbeddingTable.empty(2, 2, "float8_e4m3fn", scale_rounding=bad)

