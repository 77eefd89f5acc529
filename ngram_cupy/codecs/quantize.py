"""Quantising float tables to fp8, NVFP4 and MXFP8, streamed over row chunks (Numba, all cores).

The source rows (float32, float16 or bfloat16) are widened exactly to float32 one chunk at a time
(the only extra memory: one chunk's float32 values); the results are the arrays an
``EmbeddingTable`` and the engines' checkpoints hold:

- ``fp8``: E4M3 codes of ``value / scale`` (float32 division, clamped to +-448, rounded to nearest
  even), one float32 per-tensor ``scale`` (default ``amax / 448``);
- ``nvfp4``: a global ``scale`` (``weight_scale_2 = amax / (6 * 448)``), per 16 values an E4M3
  block scale ``RNE(block_amax / 6 / scale)``, and E2M1 codes of ``value / (block * scale)``
  (clamped to +-6, rounded to nearest with ties to the even code), two a byte, low nibble first;
- ``mxfp8``: per 32 values a UE8M0 power of two ``2**e``, the smallest with ``block_amax <= 448 *
  2**e`` (no value saturates; DeepSeek's rounding of the scale up to a power of two), and E4M3
  codes of ``value / 2**e``; in the one block scale where ``448 * 2**e`` is past float32's range
  (``2**120``, blocks whose amax is above ``1.75 * 2**127``) the codes are clamped to +-240, the
  largest whose decoded value ``code * 2**e`` is finite.

Scale rules for zeros: an all-zero table gets scale 1.0, and a table so small (a subnormal
amax) that its default scale rounds to zero the smallest positive float32, ``2**-149``; an
all-zero NVFP4 block the block scale 1.0, and a block whose scale would round to zero the
smallest E4M3 one, 2**-9; an all-zero MXFP8 block the byte 127 (1.0), and no block a byte below
1 (byte 0 reads as a zero scale).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import float32, int64, njit, prange, uint32

from ..formats import ENCODED, Format, encoded_format, find_format
from ..runtime.backends import HOST, Backend, cupy_module, unwrap_torch, where
from ..runtime.checks import check_integer
from .dequant import bits_to_float32, float32_to_bits, subnormal_bits
from .quantize_cupy import E4M3_TOP_FINITE, E4M3_VALUES, E8M0_TOP, ArrayEngine

E4M3_MAX = 448.0
E2M1_MAX = 6.0
E4M3_ONE = 0x38  # 1.0
E8M0_ONE = 127  # 2**0
SMALLEST_SCALE = np.float32(np.finfo(np.float32).smallest_subnormal)


@njit(inline="always")
def e4m3_bits(value):
    """E4M3 ("fn") bits of a finite float32 with ``|value| <= 448``, rounded to nearest even."""
    b = int64(float32_to_bits(value))
    sign = (b >> 24) & 0x80
    magnitude = b & 0x7FFFFFFF
    if magnitude >= 0x3C800000:  # normal (2**-6 and up): rebias, round off 20 mantissa bits
        rebiased = magnitude - 0x3C000000
        return sign | ((rebiased + 0x7FFFF + ((rebiased >> 20) & 1)) >> 20)
    exponent = magnitude >> 23
    if exponent < 117:  # at most 2**-10 (half the smallest subnormal): rounds to zero
        return sign
    return sign | subnormal_bits(magnitude, 141 - exponent)  # units of 2**-9


@njit(inline="always")
def e2m1_code(value):
    """The E2M1 code (S.EE.M) nearest to a float32 in [-6, 6], ties to the even code."""
    a = abs(value)
    if a <= 0.25:
        code = 0
    elif a < 0.75:
        code = 1
    elif a <= 1.25:
        code = 2
    elif a < 1.75:
        code = 3
    elif a <= 2.5:
        code = 4
    elif a < 3.5:
        code = 5
    elif a <= 5.0:
        code = 6
    else:
        code = 7
    return code | 8 if value < 0 else code


@njit(inline="always")
def clamped(value, limit):
    """``value`` clamped to ``[-limit, limit]``."""
    return min(max(value, -limit), limit)


@njit(parallel=True, cache=True)
def row_amax(values, out):
    """``out[r]``: the largest magnitude of row ``r``, +inf for a row holding NaN or inf."""
    for r in prange(values.shape[0]):
        top = float32(0.0)
        for j in range(values.shape[1]):
            v = abs(values[r, j])
            if not v < np.inf:  # NaN or inf
                top = float32(np.inf)
                break
            top = max(top, v)
        out[r] = top


@njit(parallel=True, cache=True)
def quantize_fp8_rows(values, scale, out):
    """E4M3 bits of ``value / scale``, clamped to +-448."""
    for r in prange(values.shape[0]):
        for j in range(values.shape[1]):
            q = float32(values[r, j] / scale)
            out[r, j] = e4m3_bits(clamped(q, float32(E4M3_MAX)))


@njit(parallel=True, cache=True)
def quantize_nvfp4_rows(values, scale, e4m3_values, out, blocks):
    """Packed E2M1 codes and E4M3 block scales of 16-value blocks under global ``scale``
    (``e4m3_values``: the float32 of every E4M3 byte)."""
    for r in prange(values.shape[0]):
        for k in range(blocks.shape[1]):
            top = float32(0.0)
            for j in range(16 * k, 16 * k + 16):
                top = max(top, abs(values[r, j]))
            byte = e4m3_bits(min(float32(float32(top / float32(6.0)) / scale),
                                 float32(E4M3_MAX)))
            if byte == 0:
                byte = 1 if top > 0 else E4M3_ONE
            blocks[r, k] = byte
            step = float32(e4m3_values[byte] * scale)
            for j in range(8 * k, 8 * k + 8):
                low = e2m1_code(clamped(float32(values[r, 2 * j] / step), float32(E2M1_MAX)))
                high = e2m1_code(clamped(float32(values[r, 2 * j + 1] / step),
                                         float32(E2M1_MAX)))
                out[r, j] = low | (high << 4)


@njit(inline="always")
def e8m0_byte(top):
    """The UE8M0 byte of the smallest power of two ``2**e`` with ``top <= 448 * 2**e`` (byte
    ``e + 127``, at least 1; 127 for a zero block)."""
    if top == 0:
        return E8M0_ONE
    b = int64(float32_to_bits(top))
    exponent = b >> 23
    mantissa = b & 0x7FFFFF
    if exponent == 0:  # a float32 subnormal: far below every scale byte 1 serves
        return 1
    e = exponent - 127 - 8 + (1 if mantissa > 0x600000 else 0)  # 448 = 1.75 * 2**8
    return min(max(e + 127, 1), 254)


@njit(parallel=True, cache=True)
def quantize_mxfp8_rows(values, out, blocks):
    """E4M3 bits and UE8M0 block scale bytes of 32-value blocks (codes clamped so that every
    decoded value is finite)."""
    for r in prange(values.shape[0]):
        for k in range(blocks.shape[1]):
            top = float32(0.0)
            for j in range(32 * k, 32 * k + 32):
                top = max(top, abs(values[r, j]))
            byte = e8m0_byte(top)
            blocks[r, k] = byte
            power = bits_to_float32(uint32(byte) << 23)  # 2**(byte - 127), a normal float32
            limit = float32(E4M3_TOP_FINITE if byte == E8M0_TOP else E4M3_MAX)
            for j in range(32 * k, 32 * k + 32):
                q = float32(values[r, j] / power)
                out[r, j] = e4m3_bits(clamped(q, limit))


HOST_VALUES = ArrayEngine(np)
# The largest magnitude each scaled encoder's codes reach at scale 1: the default scale is the
# table's amax over it (fp8: E4M3's 448; NVFP4: E2M1's 6 times its largest E4M3 block scale).
SCALE_LIMITS = {"fp8": E4M3_MAX, "nvfp4": E2M1_MAX * E4M3_MAX}


@dataclass(frozen=True)
class QuantizedTable:
    """A quantised table: its format, the stored ``weight`` (E4M3 codes, or NVFP4's packed
    bytes), its float32 ``scale`` (fp8: per tensor; NVFP4: the global ``weight_scale_2``; MXFP8:
    None) and ``block_scales`` (E4M3 / UE8M0, None for fp8). ``EmbeddingTable(quantized)``
    serves it; on the GPU the arrays are CuPy uint8 bits."""

    format: Format
    weight: Any
    scale: np.float32 | None
    block_scales: Any = None

    @property
    def nbytes(self) -> int:
        """Bytes of the rows and their block scales."""
        return int(self.weight.nbytes + (0 if self.block_scales is None
                                         else self.block_scales.nbytes))

    def table_arguments(self) -> dict[str, Any]:
        """The ``EmbeddingTable`` arguments that hold this table."""
        return {"weight": self.weight, "scale": self.scale, "dtype": self.format.name,
                "block_scales": self.block_scales}


def family_targets(family: str) -> tuple[str, ...]:
    """The quantised formats ``family``'s checkpoints hold (``Format.checkpoints``): what its
    engine reads (vLLM's Qwen4Exp: fp8 and NVFP4; DeepSeek's Engram: MXFP8)."""
    return tuple(to for to, fmt in ENCODED.items() if fmt.checkpoint_names(family))


def quantize_target(fmt: Format, family: str) -> str:
    """``quantize_table``'s name for ``fmt`` (``"fp8"``, ...); a ValueError when ``family``'s
    engine does not read that format."""
    name = fmt.encoder
    if name not in family_targets(family):
        raise ValueError(f"{family} tables are not quantised to {fmt.name}: its engine reads "
                         f"{' and '.join(family_targets(family))}")
    return name


def check_block(fmt: Format, block) -> None:
    """``block`` (values per block scale) must be the format's own: 16 for NVFP4, 32 for MXFP8,
    none for fp8 (the engines read no other)."""
    if block is None or (fmt.blocked and block == fmt.block and not isinstance(block, bool)):
        return
    wanted = f"{fmt.block} (or None)" if fmt.blocked else "None (fp8 has one scale per table)"
    raise ValueError(f"block for {fmt.name} must be {wanted}, got {block!r}")


def source_bits(weight) -> tuple[Any, Format, Backend]:
    """The raw bits of a float32 / float16 / bfloat16 ``[rows, head_dim]`` table (NumPy, CuPy,
    torch, or an ``EmbeddingTable``'s rows), its format and its side; TypeError / ValueError
    naming ``weight``."""
    if hasattr(weight, "total_rows") and hasattr(weight, "host_view"):  # an EmbeddingTable
        return table_bits(weight)
    value, fmt = unwrap_torch(weight)
    side = where(value)
    if side is None:
        raise TypeError(f"weight must be an array or tensor, got {type(weight).__name__}")
    array = side.asarray(value)
    fmt = fmt or find_format(array.dtype)
    if fmt is None or not fmt.output:
        raise TypeError(f"weight must be float32, float16 or bfloat16, got {array.dtype}")
    if array.ndim != 2:
        raise ValueError(f"weight must be 2-D [rows, head_dim], got shape {tuple(array.shape)}")
    return array.view(fmt.raw), fmt, side


def table_bits(table) -> tuple[Any, Format, Backend]:
    """``source_bits`` of an ``EmbeddingTable``: its rows where they live (host or device), for
    an open, whole, unscaled float table (a shard's or a scaled table's rows alone are not the
    values to quantise)."""
    fmt = table.format
    if table.closed:
        raise ValueError("weight is a closed EmbeddingTable")
    if not fmt.output:
        raise TypeError(f"weight must be a float32, float16 or bfloat16 table, got {fmt.name}")
    if table.num_rows != table.total_rows:
        stop = table.row_start + table.num_rows
        raise ValueError(f"weight holds rows [{table.row_start}, {stop}) of {table.total_rows}: "
                         "quantise the whole table, not one shard")
    if table.scale is not None:
        raise ValueError(f"weight has scale={float(table.scale)}: its rows alone are not its "
                         "values; quantise rows * scale")
    if table.host_view is not None:
        return HOST.asarray(table.host_view).view(fmt.raw), fmt, HOST
    return table.device_rows.view(fmt.raw), fmt, where(table.device_rows)


def quantize_scale(fmt: Format, scale) -> np.float32 | None:
    """A given ``scale`` checked: finite and positive (fp8, NVFP4); MXFP8 takes none."""
    if scale is None:
        return None
    if not fmt.scaled:
        raise ValueError(f"{fmt.name} takes no scale (its block scales are its only ones), got "
                         f"scale={scale!r}")
    try:
        value = np.float32(float(scale))
    except (TypeError, ValueError):
        raise TypeError(f"scale must be a number, got {type(scale).__name__}") from None
    if not (np.isfinite(value) and value > 0):
        raise ValueError(f"scale must be a finite positive number, got {value}")
    return value


def default_scale(fmt: Format, amax: float) -> np.float32:
    """``amax / 448`` (fp8) or ``amax / (6 * 448)`` (NVFP4), in float32; 1.0 for a zero table,
    and never below the smallest positive float32 (a table accepts only positive scales)."""
    if amax == 0:
        return np.float32(1.0)
    limit = SCALE_LIMITS[fmt.encoder]
    return max(np.float32(np.float32(amax) / np.float32(limit)), SMALLEST_SCALE)


def chunk_rows_for(head_dim: int, chunk_rows) -> int:
    """Rows per chunk: ``chunk_rows``, or about ``CHUNK_VALUES`` values."""
    if chunk_rows is None:
        return max(1, CHUNK_VALUES // max(head_dim, 1))
    return check_integer("chunk_rows", chunk_rows, 1)


CHUNK_VALUES = 1 << 22  # 4 Mi values a chunk: 8 MiB of bf16, within a large L3 slice


def refuse_nonfinite(amax, first_row: int) -> None:
    """A ValueError naming the first row whose ``amax`` says it holds NaN or inf."""
    bad = np.flatnonzero(~np.isfinite(amax))
    if bad.size:
        raise ValueError(f"weight row {first_row + int(bad[0])} holds NaN or inf: such rows "
                         "cannot be quantised")


class NumbaEngine:
    """The CPU kernels above, parallel over the rows of a chunk."""

    xp = np

    @staticmethod
    def to_host(array) -> np.ndarray:
        """The array itself (it is on the host)."""
        return array

    @staticmethod
    def values(bits, code: int) -> np.ndarray:
        """The chunk's float32 values (bfloat16: the bits shifted up; exact)."""
        return HOST_VALUES.values(np.ascontiguousarray(bits), code)

    @staticmethod
    def amax(values) -> np.ndarray:
        """Per-row largest magnitudes (+inf for a non-finite row)."""
        out = np.empty(values.shape[0], np.float32)
        row_amax(values, out)
        return out

    @staticmethod
    def fp8(values, scale, out, blocks) -> None:
        """Fill ``out`` with the chunk's E4M3 codes (no block scales)."""
        quantize_fp8_rows(values, np.float32(scale), out)

    @staticmethod
    def nvfp4(values, scale, out, blocks) -> None:
        """Fill ``out`` with the chunk's packed E2M1 codes and ``blocks`` with their scales."""
        quantize_nvfp4_rows(values, np.float32(scale), E4M3_VALUES, out, blocks)

    @staticmethod
    def mxfp8(values, scale, out, blocks) -> None:
        """Fill ``out`` with the chunk's E4M3 codes and ``blocks`` with their UE8M0 scales."""
        quantize_mxfp8_rows(values, out, blocks)


def engine_for(side: Backend):
    """The quantising engine of a side: Numba on the host, CuPy on the GPU."""
    return NumbaEngine if side is HOST else ArrayEngine(cupy_module())


def chunked_amax(engine, bits, source: Format, chunks) -> float:
    """The largest magnitude of a table read chunk by chunk; a ValueError naming the first
    row holding NaN or inf."""
    amax = 0.0
    for start, stop in chunks:
        row_top = engine.amax(engine.values(bits[start:stop], source.code))
        refuse_nonfinite(engine.to_host(row_top), start)
        if row_top.size:
            amax = max(amax, float(row_top.max()))
    return amax


def table_amax(weight, *, chunk_rows=None, name: str = "weight") -> float:
    """The largest magnitude of a float table, read chunk by chunk (what the default fp8 and
    NVFP4 scales come from, for a table split over several tensors); NaN or inf rows refused,
    naming ``name`` and the row."""
    bits, source, side = source_bits(weight)
    step = chunk_rows_for(bits.shape[1], chunk_rows)
    chunks = [(start, min(start + step, bits.shape[0])) for start in range(0, bits.shape[0],
                                                                           step)]
    try:
        return chunked_amax(engine_for(side), bits, source, chunks)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None


def quantize_table(weight, to: str, *, scale=None, block=None, chunk_rows=None,
                   progress=None) -> QuantizedTable:
    """Quantise a float32 / float16 / bfloat16 ``[rows, head_dim]`` table (an array, a tensor or
    an ``EmbeddingTable``: its rows) to ``to``: ``"fp8"`` (or any name of float8_e4m3fn),
    ``"nvfp4"`` or ``"mxfp8"`` (see the module docstring for the recipes and the zero rules).

    ``scale``: fp8's per-tensor scale or NVFP4's global one (default from the table's amax,
    which takes a first pass over the rows; values past ``448 * scale`` / ``6 * 448 * scale``
    saturate). ``block``: values per block scale, checked (16 NVFP4, 32 MXFP8). The rows are read
    ``chunk_rows`` at a time (about 4 Mi values by default) straight from their bits; NumPy and
    torch CPU tables are quantised on the CPU (Numba, all cores), CuPy and CUDA torch ones on
    the GPU (CuPy). ``progress``: a callable given the rows done by each chunk. A row holding
    NaN or inf is a ValueError naming it, before any output is returned.
    """
    fmt = encoded_format(to)
    check_block(fmt, block)
    given = quantize_scale(fmt, scale)
    bits, source, side = source_bits(weight)
    rows, head_dim = bits.shape
    fmt.check_head_dim(head_dim, "weight")
    step = chunk_rows_for(head_dim, chunk_rows)
    engine = engine_for(side)
    encode = getattr(engine, fmt.encoder)  # the engine's encoder the format's entry names
    xp = engine.xp
    chunks = [(start, min(start + step, rows)) for start in range(0, rows, step)]
    checked = False
    if given is None and fmt.scaled:
        given, checked = default_scale(fmt, chunked_amax(engine, bits, source, chunks)), True
    out = xp.empty((rows, fmt.row_width(head_dim)), np.uint8)
    blocks = xp.empty((rows, fmt.scale_width(head_dim)), np.uint8) if fmt.blocked else None
    for start, stop in chunks:
        piece = engine.values(bits[start:stop], source.code)
        if not checked:
            refuse_nonfinite(engine.to_host(engine.amax(piece)), start)
        encode(piece, given, out[start:stop], None if blocks is None else blocks[start:stop])
        del piece  # before the next chunk's values exist: one chunk at a time
        if progress is not None:
            progress(stop - start)
    if side is HOST:
        out = out.view(fmt.dtype)  # NVFP4's packed bytes stay uint8
        blocks = None if blocks is None else blocks.view(fmt.block_scale)
    return QuantizedTable(fmt, out, given, blocks)
