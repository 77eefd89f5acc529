"""Numba row decoders: one table row's stored elements (and block scales) to its output units,
one signature for every format pair, and where a row's elements and block scales lie (plain
rows, rows with block scales beside them, packed records). The gathers (``tables/``) name a
decoder and a layout; overloads inline the named one into the compiled gather.

Float8 -> bfloat16 with a finite scale has a branch-free formula (``fp8_to_bf16``) that LLVM
vectorises; MXFP8 -> bfloat16 blocks whose power-of-two scale keeps every value a normal
bfloat16 add the scale's exponent to the value's bits (``fp8_shifted_to_bf16``). Every decoder
gives exactly ``dequant.convert``'s bits.
"""

from __future__ import annotations

import numpy as np
from numba import float32, int64, njit, types, uint16, uint32
from numba.core.extending import overload

from ..codecs.dequant import (
    BFLOAT16,
    FLOAT8_E4M3,
    FORMATS,
    MXFP8,
    bits_to_float32,
    encode,
    float32_to_bits,
)

# float8 e4m3 subnormals are their 3 mantissa bits times 2**-9.
FLOAT8_SUBNORMAL_UNIT = np.float32(2.0**-9)
FLOAT32_MAX = np.finfo(np.float32).max
# UE8M0 scale bytes under which every float8 value (bfloat16 exponents 118 for 2**-9 to 135 for
# 448) stays a normal bfloat16 (exponents 1 to 254): the product is exact, an exponent shift.
SHIFT_SAFE = (np.uint32(127 - 117), np.uint32(127 + 254 - 135))


@njit(inline="always", boundscheck=False)
def fp8_to_bf16(bits, scale):
    """``convert(bits, FLOAT8_E4M3, scale, BFLOAT16)`` for a finite ``scale``, with selects
    instead of branches or a table lookup, so that LLVM vectorises the loops around it.

    The magnitude is scaled and rounded (nearest even is symmetric), then the stored sign flips
    the result's; the NaN pattern (magnitude 0x7F) gives the canonical NaN.
    """
    magnitude = bits & uint32(0x7F)
    normal = bits_to_float32((magnitude << uint32(20)) + uint32(120 << 23))  # rebias 7 -> 127
    value = normal if magnitude >= uint32(8) else float32(magnitude) * FLOAT8_SUBNORMAL_UNIT
    product = float32_to_bits(value * scale)
    rounded = (product + uint32(0x7FFF) + ((product >> uint32(16)) & uint32(1))) >> uint32(16)
    signed = uint16(rounded) ^ uint16((bits & uint32(0x80)) << uint32(8))
    return uint16(0x7FC0) if magnitude == uint32(0x7F) else signed


@njit(inline="always", boundscheck=False)
def fp8_shifted_to_bf16(bits, shift):
    """``fp8_to_bf16(bits, 2**k)`` for a power-of-two scale that keeps every float8 value a
    normal bfloat16 (``SHIFT_SAFE``), in integers: the value's exact bfloat16 bits with
    ``shift`` (``k << 7``, modulo 2**32) added to the exponent; zero stays zero."""
    magnitude = bits & uint32(0x7F)
    normal = (magnitude << uint32(4)) + uint32(120 << 7)  # rebias 7 -> 127
    small = float32_to_bits(float32(magnitude) * FLOAT8_SUBNORMAL_UNIT) >> uint32(16)
    value = normal if magnitude >= uint32(8) else small
    shifted = uint32(0) if magnitude == uint32(0) else (value + shift) & uint32(0xFFFF)
    signed = uint16(shifted) ^ uint16((bits & uint32(0x80)) << uint32(8))
    return uint16(0x7FC0) if magnitude == uint32(0x7F) else signed


@njit(inline="always", boundscheck=False)
def fp8_row_to_bf16(source, dest, scale):
    """``dest[c]`` = ``convert(source[c], FLOAT8_E4M3, scale, BFLOAT16)`` for one row and a finite
    ``scale`` (``fp8_to_bf16``)."""
    for c in range(source.shape[0]):
        dest[c] = fp8_to_bf16(uint32(source[c]), scale)


# ---- row decoders: one row's stored elements -> its output units, one signature for all ----
# ``decode(codes, block_scales, dest, outputs, scale, code, out_code, per_block)``: ``codes`` are
# the row's stored elements, ``block_scales`` its block scale bytes (empty without), ``outputs``
# the table of ``output_table`` and ``per_block`` the stored elements per block scale.


@njit(inline="always", boundscheck=False)
def float32_row(codes, block_scales, dest, outputs, scale, code, out_code, per_block):
    """Float32 values (too wide for a table) scaled and rounded with ``encode``: ``convert``
    without its decoding, which for float32 is the bits themselves."""
    for c in range(codes.shape[0]):
        dest[c] = encode(bits_to_float32(codes[c]) * scale, out_code)


@njit(inline="always", boundscheck=False)
def table_row(codes, block_scales, dest, outputs, scale, code, out_code, per_block):
    """Each value's output looked up among every bit pattern's (``output_table``)."""
    for c in range(codes.shape[0]):
        dest[c] = outputs[codes[c]]


@njit(inline="always", boundscheck=False)
def fp8_formula_row(codes, block_scales, dest, outputs, scale, code, out_code, per_block):
    """Float8 to bfloat16 with ``fp8_row_to_bf16`` for a finite ``scale``; a NaN or infinite
    one has no formula: the table."""
    if abs(scale) <= FLOAT32_MAX:
        fp8_row_to_bf16(codes, dest, scale)
    else:
        table_row(codes, block_scales, dest, outputs, scale, code, out_code, per_block)


@njit(inline="always", boundscheck=False)
def blocked_row(codes, block_scales, dest, outputs, scale, code, out_code, per_block):
    """One block-scaled row: ``dest[k]`` = the outputs of stored byte ``codes[k]`` under its
    block's scale byte, from the byte table ``outputs`` (``convert_units``)."""
    for j in range(block_scales.shape[0]):
        base = int64(block_scales[j]) << 8
        for k in range(j * per_block, j * per_block + per_block):
            dest[k] = outputs[base | int64(codes[k])]


@njit(inline="always", boundscheck=False)
def mxfp8_row_to_bf16(codes, block_scales, dest, outputs, scale, code, out_code, per_block):
    """``blocked_row`` of an MXFP8 row to bfloat16: each block is ``fp8_to_bf16`` with its
    power-of-two scale (exactly ``convert_blocked``: the global scale is 1), but a block with the
    infinite scale byte 255, which goes through the byte table. Each block's loop runs a constant
    ``per_block`` times on the row itself (no slices), so LLVM unrolls and vectorises it whole.
    """
    for j in range(block_scales.shape[0]):
        first = j * per_block
        byte = uint32(block_scales[j])
        if byte == uint32(0xFF):
            base = int64(byte) << 8
            for k in range(per_block):
                dest[first + k] = outputs[base | int64(codes[first + k])]
            continue
        if SHIFT_SAFE[0] <= byte <= SHIFT_SAFE[1]:
            shift = (byte - uint32(127)) << uint32(7)
            for k in range(per_block):
                dest[first + k] = fp8_shifted_to_bf16(uint32(codes[first + k]), shift)
            continue
        block_scale = bits_to_float32(byte << uint32(23))
        for k in range(per_block):
            dest[first + k] = fp8_to_bf16(uint32(codes[first + k]), block_scale)


ROW_DECODERS = {"float32": float32_row, "table": table_row, "fp8_formula": fp8_formula_row,
                "blocks": blocked_row, "mxfp8_shift": mxfp8_row_to_bf16}
# (stored, output) format pairs with a decoder of their own, faster than their kind's.
FAST_DECODERS = {(FLOAT8_E4M3, BFLOAT16): "fp8_formula", (MXFP8, BFLOAT16): "mxfp8_shift"}


# Decoders whose code depends on the output format (the rest read their outputs from a table).
FORMAT_DECODERS = {"float32"}


def decoder_formats(decoder: str, code: int, out_code: int) -> tuple[int, int]:
    """``(code, out_code)`` as the compiled ``decoder`` needs them: a decoder that computes its
    outputs keeps both; one reading them from ``output_table`` needs neither (-1, -1), so that
    the pairs sharing its code share one compiled kernel."""
    return (code, out_code) if decoder in FORMAT_DECODERS else (-1, -1)


def row_decoder(code: int, out_code: int) -> str:
    """The ``ROW_DECODERS`` entry for rows of format ``code`` read as ``out_code``: the pair's
    own (``FAST_DECODERS``), else by byte and block scale for block-scaled rows, the table for
    1- and 2-byte values, and ``encode`` alone for float32."""
    fmt = FORMATS[code]
    if (code, out_code) in FAST_DECODERS:
        return FAST_DECODERS[code, out_code]
    if fmt.blocked:
        return "blocks"
    return "table" if fmt.itemsize <= 2 else "float32"


# ---- row layouts: where a row's stored elements and its block scales lie ----
# ``parts(table, scales, row, width, scale_width)`` is row ``row``'s ``(codes, block_scales)``.


@njit(inline="always", boundscheck=False)
def plain_parts(table, scales, row, width, scale_width):
    """``table[row]`` and no block scales."""
    return table[row], table[row, :0]


@njit(inline="always", boundscheck=False)
def split_parts(table, scales, row, width, scale_width):
    """``table[row]`` and its block scales beside it, ``scales[row]``."""
    return table[row], scales[row]


@njit(inline="always", boundscheck=False)
def record_parts(table, scales, row, width, scale_width):
    """The codes and block scales in record ``table[row]`` (``packed``; ``scales`` unused)."""
    record = table[row]
    return record[:width], record[width:width + scale_width]


ROW_LAYOUTS = {"plain": plain_parts, "split": split_parts, "record": record_parts}


def row_layout(code: int, packed: bool) -> str:
    """The ``ROW_LAYOUTS`` entry for rows of format ``code``: records, rows with their block
    scales beside them, or plain rows."""
    return "record" if packed else "split" if FORMATS[code].blocked else "plain"


def decode_row(decoder, codes, block_scales, dest, outputs, scale, code, out_code, per_block):
    """``ROW_DECODERS[decoder](codes, ...)`` in compiled code, chosen while compiling."""
    raise TypeError("decode_row runs in compiled code only")


def row_parts(layout, table, scales, row, width, scale_width):
    """``ROW_LAYOUTS[layout](table, ...)`` in compiled code, chosen while compiling."""
    raise TypeError("row_parts runs in compiled code only")


# The gather names its row functions (``decoder`` and ``layout`` are closure constants, so
# literals), and these overloads inline the named one: a dispatcher in the closure would change
# Numba's disk cache key in every process. (Numba inlines no ``function(*args)``: the
# parameters are spelled out.)
@overload(decode_row, prefer_literal=True, inline="always")
def decode_named_row(decoder, codes, block_scales, dest, outputs, scale, code, out_code,
                     per_block):
    """The implementation of ``decode_row`` for a literal ``decoder``."""
    if not isinstance(decoder, types.StringLiteral):
        return None
    function = ROW_DECODERS[decoder.literal_value]

    def decode(decoder, codes, block_scales, dest, outputs, scale, code, out_code, per_block):
        function(codes, block_scales, dest, outputs, scale, code, out_code, per_block)

    return decode


@overload(row_parts, prefer_literal=True, inline="always")
def named_row_parts(layout, table, scales, row, width, scale_width):
    """The implementation of ``row_parts`` for a literal ``layout``."""
    if not isinstance(layout, types.StringLiteral):
        return None
    function = ROW_LAYOUTS[layout.literal_value]
    return lambda layout, table, scales, row, width, scale_width: function(
        table, scales, row, width, scale_width)
