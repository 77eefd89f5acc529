"""Every format's decoders agree with each other: the plain NumPy / ml_dtypes definition
(``dequant.reference_lookup`` / ``reference_block_lookup``), the Numba CPU gather (an
``EmbeddingTable`` lookup) and the CUDA C header (``kernels/dequant.cuh`` built for the host),
on every stored code (every block scale byte too) and every output format. The harness is
generated from the format registry, so a new format entry is checked here with no new test."""

from __future__ import annotations

import ctypes
import math
import shutil
import subprocess

import numpy as np
import pytest
from conftest import assert_same

import ngram_cupy as nc
from ngram_cupy.codecs import dequant
from ngram_cupy.formats import FORMATS, OUTPUT_CODES
from ngram_cupy.tables import gather_cupy, gather_numba


def harness() -> str:
    """C++ calling the header's decoder of every (format, output) pair on one value each."""
    pairs = []
    for fmt in FORMATS:
        for out in OUTPUT_CODES:
            call = (f"ngram::convert_blocked<{fmt.code}, {out}>(bits[i], "
                    f"ngram::block_value<{fmt.code}>(blocks[i]), scale)" if fmt.blocked
                    else f"ngram::convert<{fmt.code}, {out}>(bits[i], scale)")
            pairs.append(f"if (code == {fmt.code} && out_code == {out}) {{ for (long i = 0; "
                         f"i < n; ++i) out[i] = {call}; return 0; }}")
    return ("#define NGRAM_HOST_TEST\n#include \"dequant.cuh\"\n"
            "extern \"C\" int decode_all(int code, int out_code, const unsigned* bits, "
            "const unsigned* blocks, long n, float scale, unsigned* out) {\n"
            + "\n".join(pairs) + "\nreturn 1; }\n")


@pytest.fixture(scope="module")
def header_decoder(tmp_path_factory):
    """``decode_all`` of the generated harness, built by the host's C++ compiler (None without
    one)."""
    compiler = shutil.which("g++") or shutil.which("clang++")
    if compiler is None:  # the other decoders are still compared
        return None
    folder = tmp_path_factory.mktemp("decoders")
    (folder / "harness.cpp").write_text(harness())
    library = folder / "harness.so"
    subprocess.run([compiler, "-std=c++17", "-O1", "-shared", "-fPIC", "-ffp-contract=off",
                    f"-I{gather_cupy.KERNEL_DIR}", str(folder / "harness.cpp"), "-o",
                    str(library)], check=True)
    decode_all = ctypes.CDLL(str(library)).decode_all
    decode_all.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                           ctypes.c_long, ctypes.c_float, ctypes.c_void_p]
    return decode_all


def every_code(fmt) -> tuple[np.ndarray, np.ndarray | None, np.ndarray, np.ndarray]:
    """``(rows, block_scales, codes, blocks)``: a table of ``fmt`` holding every stored code
    (float32: edges and random bits), under every block scale byte for a block-scaled format,
    and the per-value codes and block scale bytes of its rows in order."""
    if fmt.blocked:  # row r: every code, under block scale byte r
        count = 1 << (8 * fmt.itemsize // fmt.pack)  # codes of one value
        head_dim = math.lcm(count, fmt.block)
        codes = np.tile(np.arange(count, dtype=np.uint32), (256, head_dim // count))
        scales = np.repeat(np.arange(256, dtype=np.uint8)[:, None], head_dim // fmt.block, 1)
        stored = codes.astype(np.uint8)
        if fmt.pack == 2:  # two codes a byte, the low nibble first
            stored = stored[:, 0::2] | (stored[:, 1::2] << 4)
        blocks = np.repeat(scales, fmt.block, axis=1).astype(np.uint32)
        return stored, scales, codes.reshape(-1), blocks.reshape(-1)
    if fmt.itemsize < 4:
        codes = np.arange(1 << (8 * fmt.itemsize), dtype=np.uint32)
    else:
        rng = np.random.default_rng(0)
        edges = [0, 0x80000000, 1, 0x007FFFFF, 0x00800000, 0x387FE000, 0x477FF000, 0x7F7FFFFF,
                 0x7F800000, 0x7F800001, 0xFFC00000]
        codes = np.concatenate([np.array(edges, np.uint32),
                                rng.integers(0, 1 << 32, 60_000, dtype=np.uint64)
                                .astype(np.uint32)])
    codes = codes[: codes.size // 16 * 16]
    return codes.astype(fmt.raw).reshape(-1, 16), None, codes, np.zeros_like(codes)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_every_decoder_of_a_format_agrees(header_decoder, fmt):
    rows, block_scales, codes, blocks = every_code(fmt)
    ids = np.arange(rows.shape[0]).reshape(-1, 1)
    for scale in ((0.375, 7.0e-30, 3.0e4) if fmt.scaled else (None,)):
        table = nc.EmbeddingTable(rows.view(fmt.dtype) if not fmt.blocked else rows,
                                  scale=scale, dtype=fmt.name, block_scales=block_scales,
                                  scale_rounding="float32")
        for out_code in OUTPUT_CODES:
            out = FORMATS[out_code]
            factor = np.float32(1.0 if scale is None else scale)
            if fmt.blocked:
                want = dequant.reference_block_lookup(fmt, rows, block_scales, factor, ids,
                                                      out.dtype)
            else:
                want = dequant.reference_lookup(rows.view(fmt.dtype), ids, factor, out.dtype,
                                                "float32")
            numba = table.lookup(ids, out_dtype=out.name)
            message = f"{fmt.name} -> {out.name}, scale {scale}"
            assert_same(numba, want, "Numba gather " + message)
            if header_decoder is None:
                continue
            header = np.empty(codes.size, np.uint32)
            assert header_decoder(fmt.code, out_code, codes.ctypes.data, blocks.ctypes.data,
                                  codes.size, factor, header.ctypes.data) == 0
            header = header.astype(out.raw).view(out.dtype).reshape(want.shape)
            assert_same(header, want, "dequant.cuh " + message)


def test_every_entry_of_every_output_table_is_the_reference_output():
    """``output_table`` (built as uint64 by one compile of each builder, then narrowed) holds
    the reference output of every stored code, every block scale byte and value of a byte."""
    for fmt in FORMATS[1:]:  # float32 converts without a table
        rows, block_scales, codes, blocks = every_code(fmt)
        ids = np.arange(rows.shape[0]).reshape(-1, 1)
        value_bits = 8 * fmt.itemsize // fmt.pack
        for scale in ((0.375, 7.0e-30, 3.0e4) if fmt.scaled else (1.0,)):
            factor = np.float32(scale)
            for out_code in OUTPUT_CODES:
                out = FORMATS[out_code]
                table = gather_numba.output_table(fmt.code, out_code,
                                                  int(factor.view(np.uint32)))
                if fmt.blocked:
                    want = dequant.reference_block_lookup(fmt, rows, block_scales, factor, ids,
                                                          out.dtype)
                else:
                    want = dequant.reference_lookup(rows.view(fmt.dtype), ids, factor,
                                                    out.dtype, "float32")
                # want[block, code]: the output of each value code under each block scale byte
                want = want.reshape(256 if fmt.blocked else 1, -1)[:, : 1 << value_bits]
                index = np.arange(table.size)[:, None]
                values = (index % (table.size // want.shape[0])) >> (
                    np.arange(fmt.pack) * value_bits) & ((1 << value_bits) - 1)
                got = table.view(out.raw).reshape(table.size, fmt.pack).view(out.dtype)
                assert_same(got, want[index // (table.size // want.shape[0]), values],
                            f"{fmt.name} -> {out.name}, scale {scale}")
    assert len(gather_numba._convert_all_kernel().signatures) == 1
    assert len(gather_numba._convert_units_kernel().signatures) == 1
