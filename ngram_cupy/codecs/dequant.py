"""The decoding of every format of ``formats.py``, exactly: the plain NumPy / ``ml_dtypes``
definition of a lookup (``reference_lookup``, ``reference_block_lookup``) and the bit-level
functions the Numba CPU and CUDA code share.

Rows are stored as float32, float16, bfloat16 or float8 e4m3 (``ml_dtypes`` types on the NumPy
side, raw unsigned bits everywhere else), or block-scaled as NVFP4 (E2M1 codes with an E4M3 scale
per 16 values) or MXFP8 (E4M3 values with a UE8M0 scale per 32). A value is decoded to float32,
multiplied by its block scale (block-scaled formats; exact) and the table's float32 scale, and
rounded once, to nearest even, to the output type. Every bit-level function works on integer
bit patterns, so the CPU, the CUDA simulator and compiled CUDA give the same bits; NaNs come out
as one canonical quiet NaN (CUDA and x86 disagree on NaN payloads). ``kernels/dequant.cuh`` is
the CUDA C twin of this file; ``tests/codecs/test_decoders.py`` compares them on every code.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
from llvmlite import ir
from numba import float32, int64, types, uint32
from numba.core.extending import intrinsic, overload

from ..formats import (
    BFLOAT16,
    FLOAT8_E4M3,
    FLOAT16,
    FLOAT32,
    FORMATS,
    MXFP8,
    NVFP4,
    OUTPUT_CODES,
    Format,
    default_output,
    output_format,
    storage_format,
)
from ..runtime.jitable import inline_jitable

# The format registry lives in formats.py; its names stay importable from here.
__all__ = [
    "BFLOAT16", "FLOAT16", "FLOAT32", "FLOAT8_E4M3", "FORMATS", "OUTPUT_CODES", "Format",
    "MXFP8", "NVFP4", "SCALE_ROUNDINGS", "block_value", "check_scale_rounding", "convert",
    "convert_blocked", "decode", "default_output", "encode", "output_format",
    "reference_block_lookup", "reference_lookup", "rounded_scale", "storage_format",
]


SCALE_ROUNDINGS = ("output", "float32")


def check_scale_rounding(scale_rounding) -> str:
    """``"output"`` (vLLM 0.33) or ``"float32"``; a ValueError naming the argument otherwise."""
    if scale_rounding not in SCALE_ROUNDINGS:
        raise ValueError(f"scale_rounding must be 'output' or 'float32', got {scale_rounding!r}")
    return scale_rounding


def rounded_scale(scale, out_dtype, scale_rounding: str = "output") -> np.float32:
    """The float32 scale a lookup multiplies by. ``"output"``: the scale first rounded (to
    nearest even) to the output dtype, as vLLM 0.33's ``rows.to(dtype) * scale.to(dtype)``
    does (docs/tables.md; a float8 value is exact in the output dtype, so only the scale and the
    product round); ``"float32"``: the scale as it is (one rounding of the product)."""
    scale = np.float32(scale)
    if check_scale_rounding(scale_rounding) == "float32":
        return scale
    with np.errstate(over="ignore"):  # a scale past float16's range is inf there, as in torch
        return np.float32(scale.astype(np.dtype(out_dtype)))


def reference_lookup(table: np.ndarray, ids: np.ndarray, scale, out_dtype,
                     scale_rounding: str = "output") -> np.ndarray:
    """Plain NumPy / ml_dtypes definition of a lookup: ``(float32(table[ids]) * scale)`` rounded
    to ``out_dtype``, the scale first rounded as ``scale_rounding`` says (``rounded_scale``).

    Ids outside ``[0, rows)`` give zero rows. Tests compare every backend with this.
    """
    ids = np.asarray(ids, dtype=np.int64)
    valid = (ids >= 0) & (ids < table.shape[0])
    scale = rounded_scale(scale, out_dtype, scale_rounding)
    with np.errstate(over="ignore", invalid="ignore"):  # inf * 0 and overflow are intended
        rows = table[np.where(valid, ids, 0)].astype(np.float32) * scale
        rows[~valid] = 0
        rows = rows.astype(out_dtype)
    return rows.reshape(ids.shape[0], ids.shape[1] * table.shape[1])


E2M1_MAGNITUDES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)


def reference_block_lookup(fmt: Format, weight: np.ndarray, block_scales: np.ndarray, scale,
                           ids: np.ndarray, out_dtype, row_start: int = 0) -> np.ndarray:
    """Plain NumPy / ml_dtypes definition of a block-scaled lookup (docs/tables.md):
    ``(value * block scale) * scale`` in float32, rounded once to ``out_dtype``.

    NVFP4: ``weight`` the packed ``[rows, head_dim / 2]`` bytes (low nibble first),
    ``block_scales`` the ``[rows, head_dim / 16]`` E4M3 bytes. MXFP8: ``weight`` E4M3
    ``[rows, head_dim]`` (or its bytes), ``block_scales`` ``[rows, head_dim / 32]`` UE8M0 bytes
    read as the float32 of bits ``byte << 23``. Owned global rows start at ``row_start``; other
    ids give zero rows.
    """
    scale_bytes = np.asarray(block_scales).view(np.uint8)
    if fmt.code == MXFP8:
        values = np.asarray(weight).view(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(
            np.float32)
        blocks = (scale_bytes.astype(np.uint32) << 23).view(np.float32)
    else:
        assert fmt.code == NVFP4
        codes = np.stack([weight & 0xF, weight >> 4], axis=-1).reshape(weight.shape[0], -1)
        values = np.where(codes & 8, -E2M1_MAGNITUDES[codes & 7], E2M1_MAGNITUDES[codes & 7])
        blocks = scale_bytes.view(fmt.block_scale).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        decoded = (values * np.repeat(blocks, fmt.block, axis=1)) * np.float32(scale)
    local = np.asarray(ids, dtype=np.int64) - row_start
    valid = (local >= 0) & (local < weight.shape[0])
    rows = decoded[np.where(valid, local, 0)]
    rows[~valid] = 0
    with np.errstate(over="ignore", invalid="ignore"):
        return rows.astype(out_dtype).reshape(local.shape[0], -1)


def float32_values(values, fmt: Format):
    """Values of an output format ``fmt`` (NumPy or CuPy; bfloat16 as its own type or its bits)
    as float32, exactly: bfloat16's bits are a float32's upper half, float32 holds every
    float16."""
    if fmt.code == BFLOAT16:
        return (values.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return values.astype(np.float32, copy=False)


# ---- bit casts: NumPy views in Python (the CUDA simulator), one LLVM bitcast when compiled ----

def bits_to_float32(bits):
    """The float32 whose bit pattern is ``bits`` (0 <= bits < 2**32)."""
    return np.uint32(bits).view(np.float32)


def float32_to_bits(value):
    """The bit pattern of a float32 as a non-negative integer."""
    return np.float32(value).view(np.uint32)


@intrinsic
def _bitcast_to_float32(typingctx, bits):
    """uint32 -> float32, reinterpreting the bits."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen


@intrinsic
def _bitcast_to_uint32(typingctx, value):
    """float32 -> uint32, reinterpreting the bits."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@overload(bits_to_float32)
def _bits_to_float32_compiled(bits):
    return lambda bits: _bitcast_to_float32(uint32(bits))


@overload(float32_to_bits)
def _float32_to_bits_compiled(value):
    return lambda value: _bitcast_to_uint32(float32(value))


# ---- decoding: raw bits of a stored value -> float32 (all integer work in int64) ----

@inline_jitable
def decode(bits, code):
    """The float32 value of stored bits in format ``code`` (exact: every format widens)."""
    b = int64(bits)
    if code == FLOAT32:
        return bits_to_float32(b)
    if code == BFLOAT16:
        return bits_to_float32(b << 16)
    if code == FLOAT16:
        sign = (b & 0x8000) << 16
        exponent = (b >> 10) & 0x1F
        mantissa = b & 0x3FF
        if exponent == 0:  # zero or subnormal: mantissa * 2**-24 (no float32 subnormal involved,
            magnitude = float32(mantissa) * float32(2.0**-24)  # so flush-to-zero cannot bite)
            return -magnitude if sign else magnitude
        if exponent == 0x1F:  # infinity or NaN
            return bits_to_float32(sign | 0x7F800000 | (mantissa << 13))
        return bits_to_float32(sign | ((exponent + 112) << 23) | (mantissa << 13))
    if code == NVFP4:  # one E2M1 code: S.EE.M, [0, .5, 1, 1.5, 2, 3, 4, 6]
        magnitude = b & 0x7
        if magnitude < 2:  # zero or the subnormal 0.5
            return bits_to_float32(((b & 0x8) << 28) | (0x3F000000 if magnitude else 0))
        return bits_to_float32(((b & 0x8) << 28) | ((magnitude + 252) << 22))
    # FLOAT8_E4M3 ("fn": no infinities, NaN only at S.1111.111)
    sign = (b & 0x80) << 24
    exponent = (b >> 3) & 0xF
    mantissa = b & 0x7
    if exponent == 0:  # zero or subnormal: mantissa * 2**-9
        magnitude = float32(mantissa) * float32(2.0**-9)
        return -magnitude if sign else magnitude
    if exponent == 0xF and mantissa == 0x7:
        return bits_to_float32(0x7FC00000)
    return bits_to_float32(sign | ((exponent + 120) << 23) | (mantissa << 20))


# ---- encoding: float32 -> output bits, rounded to nearest even ----

@inline_jitable
def subnormal_bits(magnitude, shift):
    """The float32 ``magnitude``'s significand in units ``2**shift`` times its last bit's,
    rounded to nearest even: a subnormal's bits in a narrower float type."""
    significand = (magnitude & 0x7FFFFF) | 0x800000
    quotient = significand >> shift
    remainder = significand & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    if remainder > half or (remainder == half and (quotient & 1) == 1):
        quotient += 1
    return quotient


@inline_jitable
def _float16_bits(b):
    """IEEE half bits of the non-NaN float32 bits ``b``, rounded to nearest even."""
    sign = (b >> 16) & 0x8000
    magnitude = b & 0x7FFFFFFF
    if magnitude >= 0x477FF000:  # 65520 and up round to infinity
        return sign | 0x7C00
    if magnitude >= 0x38800000:  # normal half: rebias the exponent, round off 13 mantissa bits
        rebiased = magnitude - 0x38000000
        return sign | ((rebiased + 0xFFF + ((rebiased >> 13) & 1)) >> 13)
    exponent = magnitude >> 23
    if exponent < 102:  # below 2**-25: rounds to zero
        return sign
    return sign | subnormal_bits(magnitude, 126 - exponent)  # units of 2**-24


@inline_jitable
def encode(value, code):
    """Bits of float32 ``value`` in output format ``code``, rounded to nearest even."""
    b = int64(float32_to_bits(value))
    if (b & 0x7FFFFFFF) > 0x7F800000:  # NaN: one canonical quiet NaN per format
        if code == FLOAT32:
            return int64(0x7FC00000)
        return int64(0x7FC0) if code == BFLOAT16 else int64(0x7E00)
    if code == FLOAT32:
        return b
    if code == BFLOAT16:
        return (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return _float16_bits(b)


@inline_jitable
def convert(bits, code, scale, out_code):
    """Output bits of one stored value: decode, multiply by the float32 scale, round once."""
    return encode(decode(bits, code) * scale, out_code)


@inline_jitable
def block_value(bits, code):
    """The float32 value of a block scale byte of block-scaled format ``code``: NVFP4's E4M3;
    MXFP8's UE8M0 as vLLM reads it, the float32 of bits ``byte << 23`` (``2**(byte - 127)``, 0.0
    for byte 0, +inf for 255)."""
    if code == MXFP8:
        return bits_to_float32(int64(bits) << 23)
    return decode(bits, FLOAT8_E4M3)


@inline_jitable
def convert_blocked(bits, block_bits, code, scale, out_code):
    """Output bits of one value of a block-scaled format: ``(value * block) * scale`` in
    float32 (the first product is exact), rounded once (vLLM 0.33's order, docs/tables.md)."""
    return encode((decode(bits, code) * block_value(block_bits, code)) * scale, out_code)
