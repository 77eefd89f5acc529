"""CPU gather of table rows with Numba: parallel over tokens, GIL released, dequantisation fused.

Float8, float16 and bfloat16 values convert through a table of every bit pattern's output (256
or 65,536 entries, built once per format pair and scale with ``dequant.convert``), so the inner
loop is a load, a lookup and a store; float32 values are converted directly. Float8 -> bfloat16
(the released tables) with a finite scale uses a branch-free formula instead, which LLVM turns
into AVX2 code (16 values a step): ~7% faster than the lookup, measured on a Zen 3 core. All
give exactly ``dequant.convert``'s bits, as the GPU kernels do. MXFP8 -> bfloat16 blocks whose
power-of-two scale keeps every value a normal bfloat16 add the scale's exponent to the value's
bits in integers (no float math): 0.86-1.00x the fp8 gather's time, where multiplying was 1.23x.
The rows of the next token are prefetched while the current one converts: random rows of a
large table are otherwise read one cache miss at a time. A tiered table (``hot_rows``) reads
each hot row from its hot tier instead of the table, and counts the rows read from each tier.
Block-scaled rows (NVFP4, MXFP8) convert whole bytes through a table of every (block scale
byte, stored byte) pair's outputs (65,536 entries; an NVFP4 entry holds both values' output
bits, written as one pair): a load, a lookup and a store a byte.
"""

from __future__ import annotations

from functools import cache, lru_cache

import numpy as np
from llvmlite import ir
from numba import int64, njit, prange, types, uint64
from numba.core.extending import intrinsic

from .. import formats
from ..codecs import dequant, row_decoders
from ..codecs.dequant import (
    FLOAT32,
    FORMATS,
    convert,
    convert_blocked,
)
from ..codecs.row_decoders import decode_row, decoder_formats, row_decoder, row_layout, row_parts
from ..codecs.scales import require_block_scales
from ..runtime.cpu_threads import use_threads
from ..runtime.jitable import read_only, source_digest
from . import hot_rows
from .hot_rows import HotRowMap, hot_slot
from .row_ids import NO_BAD_ID, UNCHECKED, raise_recorded

# Numba's on-disk cache only watches this file: the digest of dequant.py in the kernels' closure
# changes the cache key whenever the shared decoding (the row decoders, or the hot-row slot
# map) changes.
DEQUANT_DIGEST = source_digest(dequant, formats, hot_rows, row_decoders)

# Rows below which a thread pool costs more than it saves (decode batches of a few hundred tokens).
PARALLEL_MIN_ROWS = 8192
# The same when every core is taken (4,096 tokens, 65,536 rows, still gain from threads there).
PARALLEL_BUSY_MIN_ROWS = 1 << 15
# Tokens per parallel work item.
BLOCK = 64
CACHE_LINE = 64
NO_EXPECTED = np.zeros((0, 0), dtype=np.int64)
NO_WORDS = np.zeros(0, dtype=np.uint64)
NO_RANKS = np.zeros(0, dtype=np.uint32)
# The ids the kernels read: int32 ids are widened (``gather_rows``), one compile for both.
ID_TYPE = np.dtype(np.int64)
NO_SCALES = np.zeros((0, 0), dtype=np.uint8)
NO_SCALES.flags.writeable = False  # typed as the read-only block scales (``read_only``)


@intrinsic
def prefetch_line(typingctx, array, index):
    """Hint the CPU to load 1-D ``array[index]``'s cache line (LLVM ``prefetch``; no fault)."""

    def codegen(context, builder, signature, args):
        view = context.make_array(signature.args[0])(context, builder, args[0])
        offset = builder.mul(args[1], builder.extract_value(view.strides, 0))
        address = builder.add(builder.ptrtoint(view.data, ir.IntType(64)), offset)
        byte_pointer = ir.IntType(8).as_pointer()
        signature_ir = ir.FunctionType(ir.VoidType(), [byte_pointer] + [ir.IntType(32)] * 3)
        hint = builder.module.declare_intrinsic("llvm.prefetch", fnty=signature_ir)
        flags = [ir.Constant(ir.IntType(32), value) for value in (0, 3, 1)]  # read, keep, data
        builder.call(hint, [builder.inttoptr(address, byte_pointer), *flags])
        return context.get_dummy_value()

    return types.void(array, types.int64), codegen


@njit(inline="always", boundscheck=False)
def prefetch_row(codes, block_scales, line):
    """Hint the lines of a row's codes (``line`` elements each) and of its block scales: neither
    need be a line multiple, so their last lines too."""
    for c in range(0, codes.shape[0], line):
        prefetch_line(codes, int64(c))
    prefetch_line(codes, int64(codes.shape[0] - 1))
    if block_scales.shape[0] != 0:
        prefetch_line(block_scales, int64(0))
        prefetch_line(block_scales, int64(block_scales.shape[0] - 1))


@cache
def gather_kernel(code: int, out_code: int, parallel: bool, tiered: bool = False,
                  packed: bool = False):
    """The gather for one (storage, output) format pair, threaded or not, tiered or not, ``nogil``:
    one kernel for all the pairs whose rows decode with the same code (``decoder_formats``:
    float16 and bfloat16 rows read as float16 or bfloat16 share the table lookup's)."""
    fmt = FORMATS[code]
    decoder = row_decoder(code, out_code)
    return _gather_kernel(decoder, row_layout(code, packed), CACHE_LINE // fmt.itemsize,
                          max(fmt.block // fmt.pack, 1), parallel, tiered,
                          *decoder_formats(decoder, code, out_code))


@cache
def _gather_kernel(decoder: str, layout: str, line: int, per_block: int, parallel: bool,
                   tiered: bool, code: int, out_code: int, digest: int = DEQUANT_DIGEST):
    """One loop over the ids, with the row functions of ``decoder`` (``row_decoder``) and of
    its rows' ``layout`` (``row_layout``); ``line``: stored elements per cache line,
    ``per_block``: stored elements per block scale, ``code`` and ``out_code`` as the decoder
    needs them.

    Numba's disk cache keys an entry by the code and the closure's values, not by ``parallel=``,
    so the serial gather is its own closure (one block); ``digest`` ties it to dequant.py.
    Tiered, hot rows (``hot_slot(hot_words, hot_ranks, local) >= 0``) are read from ``hot`` and
    ``counts[block]`` gets the block's ``(hot, cold)`` rows read. ``bad[block]`` gets the flat
    position of the block's first id outside ``[0, total_rows)`` (-1: none; ``total_rows`` -1:
    unchecked), found on the zero-row branch, so rows inside the shard pay nothing for it.
    The ``record`` layout reads ``table`` (and ``hot``) as block-scaled records (``packed``):
    row ``r``'s ``width`` stored bytes then its block scales, read as one record.
    """
    block_size = BLOCK if parallel else 1 << 62

    def gather(table, row_start, scale, outputs, ids, expected, out, hot_words, hot_ranks, hot,
               counts, scales, hot_scales, total_rows, bad, width):
        rows = table.shape[0]
        scale_width = width // per_block  # ``width``: stored elements a row, ``out``'s units
        num_tokens, num_heads = ids.shape
        check = expected.shape[0] != 0 or (digest & 0) != 0  # digest: cache key only
        for block in prange((num_tokens + block_size - 1) // block_size):
            last = min(block * block_size + block_size, num_tokens)
            hot_read = 0
            cold_read = 0
            first_bad = int64(-1)
            for t in range(block * block_size, last):
                for h in range(num_heads):  # the next token's rows load while these convert
                    ahead = int64(ids[t + 1, h]) - row_start if t + 1 < last else int64(-1)
                    if 0 <= ahead < rows:
                        slot = hot_slot(hot_words, hot_ranks, ahead) if tiered else int64(-1)
                        source = hot if slot >= 0 else table
                        source_scales = hot_scales if slot >= 0 else scales
                        codes, block_scales = row_parts(layout, source, source_scales,
                                                        slot if slot >= 0 else ahead, width,
                                                        scale_width)
                        prefetch_row(codes, block_scales, line)
                for h in range(num_heads):
                    row_id = int64(ids[t, h])
                    if check and expected[t, h] == row_id:
                        continue  # already in ``out`` from the prefetch
                    local = row_id - row_start
                    first = h * width
                    if 0 <= local < rows:
                        slot = hot_slot(hot_words, hot_ranks, local) if tiered else int64(-1)
                        hot_read += slot >= 0
                        cold_read += slot < 0
                        source = hot if slot >= 0 else table
                        source_scales = hot_scales if slot >= 0 else scales
                        codes, block_scales = row_parts(layout, source, source_scales,
                                                        slot if slot >= 0 else local, width,
                                                        scale_width)
                        decode_row(decoder, codes, block_scales, out[t, first:first + width],
                                   outputs, scale, code, out_code, per_block)
                    else:  # another shard's id, or one outside the whole table: its first noted
                        outside = total_rows >= 0 and (row_id < 0 or row_id >= total_rows)
                        if outside and first_bad < 0:
                            first_bad = int64(t * num_heads + h)
                        for c in range(width):
                            out[t, first + c] = 0
            bad[block] = first_bad
            if tiered:
                counts[block, 0] += hot_read
                counts[block, 1] += cold_read

    return njit(cache=True, nogil=True, parallel=parallel)(gather)


@cache
def _convert_all_kernel(digest: int = DEQUANT_DIGEST):
    """``convert_all(code, scale, out_code, out)``: ``out[b]`` = the output bits of every stored
    bit pattern ``b``. It inlines dequant.py, so ``digest`` is in its disk cache key too."""

    def convert_all(code, scale, out_code, out):
        for bits in range(out.size + (digest & 0)):  # digest: cache key only
            out[bits] = convert(bits, code, scale, out_code)

    return njit(cache=True)(convert_all)


@cache
def _convert_units_kernel(digest: int = DEQUANT_DIGEST):
    """``convert_units(code, scale, out_code, pack, out_bits, out)``: ``out[block << 8 | byte]``
    = the output bits of the ``pack`` values of stored ``byte`` under block scale ``block``,
    ``out_bits`` bits each, the first value in the low bits (a block-scaled format's byte
    table)."""

    def convert_units(code, scale, out_code, pack, out_bits, out):
        value_bits = 8 // pack
        for index in range(out.size + (digest & 0)):  # digest: cache key only
            entry = uint64(0)
            for p in range(pack):
                value = ((index & 0xFF) >> (p * value_bits)) & ((1 << value_bits) - 1)
                bits = convert_blocked(value, index >> 8, code, scale, out_code)
                entry |= uint64(bits) << uint64(p * out_bits)
            out[index] = entry

    return njit(cache=True)(convert_units)


def unit_dtype(code: int, out_code: int) -> np.dtype:
    """The unsigned type holding the outputs of one stored element: the pair of output values
    of an NVFP4 byte (uint32 for bf16 / fp16 out, uint64 for float32), else the output's."""
    return np.dtype(f"u{FORMATS[code].pack * FORMATS[out_code].itemsize}")


@lru_cache(maxsize=64)
def output_table(code: int, out_code: int, scale_bits: int):
    """The output bits of every bit pattern of a 1- or 2-byte format (read-only), for the
    float32 scale whose bits are ``scale_bits`` (bits, not the value: -0.0 and 0.0 differ);
    for a block-scaled format, the outputs of every ``block scale byte << 8 | stored byte``
    (``convert_units``)."""
    if code == FLOAT32:
        return np.zeros(1, FORMATS[out_code].raw)  # unused: float32 converts directly
    fmt = FORMATS[code]
    scale = np.uint32(scale_bits).view(np.float32)
    # Built as uint64, one compile of each builder for every output type (one a type took
    # 2-7 s each), then narrowed: every entry fits its type, so ``astype`` keeps its bits.
    if fmt.blocked:  # every (block scale byte, stored byte)
        wide = np.empty(1 << 16, np.uint64)
        _convert_units_kernel()(code, scale, out_code, fmt.pack, 8 * FORMATS[out_code].itemsize,
                                wide)
        outputs = wide.astype(unit_dtype(code, out_code))
    else:
        wide = np.empty(1 << (8 * fmt.itemsize), np.uint64)
        _convert_all_kernel()(code, scale, out_code, wide)
        outputs = wide.astype(FORMATS[out_code].raw)
    outputs.flags.writeable = False
    return outputs


def gather_rows(table: np.ndarray, code: int, row_start: int, scale: np.float32, ids: np.ndarray,
                out: np.ndarray, out_code: int, expected: np.ndarray | None = None,
                parallel: bool | None = None, hot: tuple[HotRowMap, np.ndarray] | None = None,
                counts: np.ndarray | None = None, scales: np.ndarray | None = None,
                hot_scales: np.ndarray | None = None,
                total_rows: int | None = None, records: np.ndarray | None = None) -> np.ndarray:
    """Write dequantised rows ``table[ids - row_start]`` (zeros outside the table) into ``out``.

    With ``total_rows``, an id outside ``[0, total_rows)`` is an IndexError naming the first
    (``row_ids``; found in the gather loop itself, raised after it; ``out`` is then partly
    written); ids of other shards give zero rows either way.

    ``table`` and ``out`` are raw unsigned views; ``ids`` is ``[T, H]`` int32/int64 (the kernels
    read int64: int32 ids are widened first) and ``out`` ``[T, H * head_dim]``. With ``expected``
    (int64, ``ids``' shape), heads whose id equals the expected one are skipped: ``out`` already
    holds them. ``parallel=None`` uses threads for large batches only, ``True`` whenever the
    threading layer allows (``cpu_threads``), ``False`` never. With ``hot = (slot map, hot
    rows)`` (raw, like ``table``), hot rows are read from the hot rows, and the rows read from
    each tier are added to ``counts`` (int64 ``[hot, cold]``) when given. A block-scaled table's
    ``[rows, width]`` bytes come with their ``scales`` (uint8 ``[rows, head_dim / block]``), and
    a hot tier's with ``hot_scales``. With ``records`` (``packed.packed_rows``: ``table`` and
    ``scales`` are views into them), each row is read as one record, and a hot tier's rows are
    records too (``hot``).
    """
    packed = records is not None
    if not packed:  # records hold their scales
        require_block_scales(FORMATS[code], scales, hot, hot_scales)
    scale = np.float32(scale)
    outputs = output_table(code, out_code, int(scale.view(np.uint32)))
    table, scales, records = read_only(table), read_only(scales), read_only(records)
    # int32 ids widened here: each gather compiles for int64 ids alone (compiling it for both
    # took 1-5 s a kernel); the copy is T * H * 8 bytes, nothing beside the rows it gathers,
    # and int64 ids pass as they are (a check of 0.1 us).
    if ids.dtype != ID_TYPE or not ids.flags.c_contiguous:
        ids = np.ascontiguousarray(ids, ID_TYPE)
    if hot is None:
        words, ranks, hot_table, blocks = NO_WORDS, NO_RANKS, records if packed else table, 0
    else:
        (words, ranks), hot_table = hot
        hot_table, hot_scales = read_only(hot_table), read_only(hot_scales)
        blocks = max(-(-ids.shape[0] // BLOCK), 1)  # a serial gather counts in the first
    block_counts = np.zeros((blocks, 2), np.int64)
    bad = np.full(max(-(-ids.shape[0] // BLOCK), 1), NO_BAD_ID, np.int64)
    target = out.view(unit_dtype(code, out_code)) if FORMATS[code].blocked else out
    min_rows = PARALLEL_MIN_ROWS if parallel is None else 0 if parallel else 1 << 62
    with use_threads(ids.size, min_rows, PARALLEL_BUSY_MIN_ROWS) as threaded:
        gather_kernel(code, out_code, threaded, hot is not None, packed)(
            records if packed else table, np.int64(row_start), scale, outputs, ids,
            NO_EXPECTED if expected is None else expected, target, words, ranks, hot_table,
            block_counts, NO_SCALES if scales is None or packed else scales,
            NO_SCALES if hot_scales is None or packed else hot_scales,
            np.int64(UNCHECKED if total_rows is None else total_rows), bad,
            np.int64(table.shape[1]))
    if total_rows is not None:
        raise_recorded(ids, bad, total_rows, held=(row_start, row_start + table.shape[0]))
    if counts is not None:
        counts += block_counts.sum(axis=0)
    return out
