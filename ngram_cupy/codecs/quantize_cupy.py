"""The quantisation recipes of ``quantize.py`` as whole-array operations of an array module
(CuPy on a GPU; NumPy runs the same code on the CPU, which is how the tests check it bitwise
against the Numba kernels)."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from ..formats import BFLOAT16, FLOAT16, FORMATS, MXFP8, NVFP4

# The float32 value of every E4M3 byte (NaN for the two NaN codes).
E4M3_VALUES = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
# The one UE8M0 scale a finite amax reaches where 448 * scale overflows float32 (2**120), and the
# largest E4M3 value whose product with it is finite: MXFP8 codes there are clamped to it.
E8M0_TOP = 247
E4M3_TOP_FINITE = 240.0
# Values per block scale of the block-scaled encoders.
NVFP4_BLOCK, MXFP8_BLOCK = FORMATS[NVFP4].block, FORMATS[MXFP8].block
# E2M1 codes go up by one past each midpoint; ``>=`` where the tie goes to the even code above.
E2M1_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False),
                  (3.5, True), (5.0, False))


class ArrayEngine:
    """``NumbaEngine``'s interface on the arrays of module ``xp``."""

    def __init__(self, xp: Any):
        self.xp = xp
        self.e4m3_values = xp.asarray(E4M3_VALUES)

    def to_host(self, array) -> np.ndarray:
        """A NumPy copy of ``array``."""
        return array.get() if hasattr(array, "get") else np.asarray(array)

    def values(self, bits, code: int):
        """The float32 values of raw source bits."""
        xp = self.xp
        if code == BFLOAT16:  # widened in place: one chunk of float32, no temporaries
            wide = bits.astype(xp.uint32)
            wide <<= 16
            return wide.view(xp.float32)
        if code == FLOAT16:
            return bits.view(xp.float16).astype(xp.float32)
        return bits.view(xp.float32)

    def amax(self, values):
        """Per-row largest magnitudes (+inf for a row holding NaN or inf)."""
        xp = self.xp
        magnitudes = xp.abs(values)
        top = magnitudes.max(axis=1) if magnitudes.shape[1] else \
            xp.zeros(magnitudes.shape[0], xp.float32)
        return xp.where(xp.isnan(top) | xp.isnan(magnitudes).any(axis=1), xp.float32(np.inf),
                        top)

    def e4m3(self, q):
        """E4M3 bytes of finite float32 values within +-448, rounded to nearest even."""
        xp = self.xp
        b = q.view(xp.uint32).astype(xp.int64)
        sign = (b >> 24) & 0x80
        magnitude = b & 0x7FFFFFFF
        rebiased = magnitude - 0x3C000000
        normal = (rebiased + 0x7FFFF + ((rebiased >> 20) & 1)) >> 20
        exponent = magnitude >> 23
        shift = xp.clip(141 - exponent, 21, 24)
        significand = (magnitude & 0x7FFFFF) | 0x800000
        quotient = significand >> shift
        remainder = significand & ((xp.int64(1) << shift) - 1)
        half = xp.int64(1) << (shift - 1)
        up = (remainder > half) | ((remainder == half) & ((quotient & 1) == 1))
        subnormal = xp.where(exponent < 117, 0, quotient + up)
        return (sign | xp.where(magnitude >= 0x3C800000, normal, subnormal)).astype(xp.uint8)

    def e2m1(self, q):
        """E2M1 codes of float32 values within +-6, nearest with ties to the even code."""
        xp = self.xp
        magnitude = xp.abs(q)
        code = xp.zeros(q.shape, xp.uint8)
        for midpoint, inclusive in E2M1_MIDPOINTS:
            code += (magnitude >= midpoint) if inclusive else (magnitude > midpoint)
        return code | xp.where(q < 0, 8, 0).astype(xp.uint8)

    def fp8(self, x, scale, out, blocks) -> None:
        """Fill ``out`` with the E4M3 codes of a chunk's float32 values ``x`` over ``scale``."""
        xp = self.xp
        out[...] = self.e4m3(xp.clip(x / xp.float32(scale), -448, 448).astype(xp.float32))

    def nvfp4(self, x, scale, out, blocks) -> None:
        """Fill ``out`` with the packed E2M1 codes of ``x`` (two a byte, low nibble first) and
        ``blocks`` with their E4M3 scales, one per 16 values."""
        xp = self.xp
        rows = x.shape[0]
        x = x.reshape(rows, -1, NVFP4_BLOCK)
        top = xp.abs(x).max(axis=2)
        scale = xp.float32(scale)
        byte = self.e4m3(xp.minimum((top / xp.float32(6)) / scale, xp.float32(448)))
        byte = xp.where(byte == 0, xp.where(top > 0, 1, 0x38), byte).astype(xp.uint8)
        step = self.e4m3_values[byte] * scale
        codes = self.e2m1(xp.clip(x / step[..., None], -6, 6).astype(xp.float32))
        codes = codes.reshape(rows, -1, 2)
        out[...] = codes[..., 0] | (codes[..., 1] << 4)
        blocks[...] = byte

    def mxfp8(self, x, scale, out, blocks) -> None:
        """Fill ``out`` with the E4M3 codes of ``x`` and ``blocks`` with their UE8M0 scales, one
        per 32 values."""
        xp = self.xp
        rows = x.shape[0]
        x = x.reshape(rows, -1, MXFP8_BLOCK)
        top = xp.abs(x).max(axis=2)
        byte = self.e8m0(top)
        power = (byte.astype(xp.uint32) << 23).view(xp.float32)
        limit = xp.where(byte == E8M0_TOP, xp.float32(E4M3_TOP_FINITE),
                         xp.float32(448))[..., None]
        q = xp.clip(x / power[..., None], -limit, limit).astype(xp.float32)
        out[...] = self.e4m3(q).reshape(rows, -1)
        blocks[...] = byte

    def e8m0(self, top):
        """UE8M0 bytes of the smallest powers of two ``2**e`` with ``top <= 448 * 2**e`` (at
        least 1; 127 for zero blocks)."""
        xp = self.xp
        b = top.view(xp.uint32).astype(xp.int64)
        exponent, mantissa = b >> 23, b & 0x7FFFFF
        byte = xp.clip(exponent - 8 + (mantissa > 0x600000), 1, 254)
        byte = xp.where(exponent == 0, 1, byte)
        return xp.where(top == 0, 127, byte).astype(xp.uint8)
