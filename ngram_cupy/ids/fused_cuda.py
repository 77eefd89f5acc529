"""Ids and rows in one launch: the n-gram ids kernel fused with the table gather (Numba CUDA).

Each block hashes its tokens into shared memory exactly as ``ids_cuda`` does (the same
``hashing.stage_token_ids``), optionally stores the ids, and then gathers and dequantises the rows
of those ids (``dequant.convert``) with coalesced word loads, so the ids never make a round trip
through global memory. The load width divides the row and the table's address alike: a table
adopted from an offset view is read in narrower words rather than faulting on a misaligned load.
Over a hot-row tier (``hot_rows``) the tiered variant reads each hot row from the tier, found by
the same ``hot_slot`` the tiered gathers use, and counts the rows read per tier as they do.
Block-scaled rows (NVFP4) are read the same way, several values a byte, each multiplied by its
block's scale from the scales array beside the rows (``dequant.convert_blocked``).
The simulator runs this very kernel in CI against the CPU path.
"""

from __future__ import annotations

from functools import cache
from math import gcd

import numpy as np
from numba import cuda, int64, uint64

from ..codecs.dequant import convert, convert_blocked
from ..codecs.records import whole_records
from ..codecs.scales import require_block_scales
from ..formats import FORMATS, Format
from ..hashing.arithmetic import clamp, stage_token_ids
from ..runtime.backends import cupy_module, data_address
from ..runtime.cuda_launch import NumbaKernel
from ..runtime.jitable import inline_jitable
from ..tables.bad_ids import BadIds
from ..tables.hot_rows import hot_slot
from ..tables.row_ids import NO_BAD_WORD, UNCHECKED
from .ids_cuda import device_params, staging_shape

WORD_BYTES = (8, 4, 2, 1)


def word_bytes(row_bytes: int, itemsize: int, address: int = 0) -> int:
    """The widest word (<= 8 bytes, >= one value) that tiles a row and that the table's
    ``address`` is aligned to, so that every load is aligned: one load per word."""
    return next(w for w in WORD_BYTES
                if w >= itemsize and row_bytes % w == 0 and address % w == 0)


@inline_jitable
def store_ids(staged, count, heads, first, lane, block, ids_out):
    """A block's staged ids into ``ids_out`` (rows from ``first``), its threads in turn."""
    for flat in range(lane, count * heads, block):
        row = flat // heads
        head = flat - row * heads
        ids_out[first + row, head] = staged[row, head]


@inline_jitable
def stage_block(tokens, query_start_loc, context, params, eos, ngram_size, heads_per_ngram,
                heads, first, lane, block, staged, write_ids, ids_out):
    """Hash the block's tokens from ``first`` into ``staged`` (shared), storing the ids too when
    ``write_ids``; returns how many of the block's tokens exist."""
    stage_token_ids(tokens, query_start_loc, context, params, eos, ngram_size, heads_per_ngram,
                    first + lane, staged, lane)
    cuda.syncthreads()
    count = clamp(tokens.shape[0] - first, 0, block)
    if write_ids:  # the caller wants the ids too
        store_ids(staged, count, heads, first, lane, block, ids_out)
    return count


@inline_jitable
def locate(flat, words, heads):
    """``(token, head, word)`` of a block's ``flat`` work item: token-major, then head, word."""
    item = flat // words
    row = item // heads
    return row, item - row * heads, flat - item * words


@inline_jitable
def store_word(packed, inside, per_word, bits, mask, code, scale, out_code, out, t, column):
    """The ``per_word`` values of one table word, dequantised into ``out[t, column:]``; zeros
    for an id outside the table (``inside`` false: ``packed`` was not read)."""
    for k in range(per_word):
        if inside:
            value = (packed >> uint64(k * bits)) & uint64(mask)
            out[t, column + k] = convert(value, code, scale, out_code)
        else:
            out[t, column + k] = 0


@inline_jitable
def store_blocked_word(packed, inside, per_word, bits, mask, code, scale, out_code, out, t,
                       column, scales, scale_column, row, first_value, block):
    """``store_word`` for a block-scaled format: value ``first_value + k`` of row ``row`` is
    multiplied by its block's scale byte ``scales[row, scale_column + (first_value + k) //
    block]``."""
    for k in range(per_word):
        if inside:
            value = (packed >> uint64(k * bits)) & uint64(mask)
            block_bits = scales[row, scale_column + (first_value + k) // block]
            out[t, column + k] = convert_blocked(value, block_bits, code, scale, out_code)
        else:
            out[t, column + k] = 0


@inline_jitable
def note_bad_id(bad, total_rows, row_id, position):
    """Keep in ``bad[0]`` the least ``position`` of an id outside ``[0, total_rows)``
    (``row_ids``; ``total_rows`` -1: unchecked)."""
    if total_rows >= 0 and (row_id < 0 or row_id >= total_rows):
        cuda.atomic.min(bad, 0, uint64(position))


@cache
def fused_kernel(ngram_size: int, heads_per_ngram: int, head_dim: int, code: int, out_code: int,
                 block: int | None = None, word: int | None = None, tiered: bool = False):
    """``(kernel, tokens per block)`` for one layer shape and (storage, output) format pair.

    Table rows are read as ``[rows, words]`` unsigned words of ``word`` bytes (default: the
    widest that tiles a row, for an aligned table). ``tiered``: the kernel takes a hot tier
    (``hot_words``, ``hot_ranks``: the slot map; ``hot``: the hot rows as words, like the table)
    and reads each hot row from it, counting each row read per tier into ``counts`` (uint64
    ``[lanes, 2]``: hot, cold; the lane picked by block), as ``gather_tiered_rows`` does. A
    block-scaled format's kernel reads the block scales from ``scales`` (``hot_scales`` for hot
    rows) from byte column ``scale_column``: 0 for scales in an array of their own; for packed
    records (``packed``), the records themselves as bytes, the scales just past the row's
    values (the table's words are then the whole records, of which the kernel reads the values'
    words). Other formats take any uint8 2-D placeholders there. An id outside ``[0,
    total_rows)`` notes its position (token-major) in ``bad`` (``note_bad_id``).
    """
    heads = (ngram_size - 1) * heads_per_ngram
    shape = staging_shape(heads, block)
    block = shape[0]
    fmt = FORMATS[code]
    itemsize, pack, blocked, values_per_scale = fmt.itemsize, fmt.pack, fmt.blocked, fmt.block
    row_bytes = fmt.row_width(head_dim) * itemsize
    word = word_bytes(row_bytes, itemsize) if word is None else word
    per_word = word // itemsize * pack  # values per word
    words = head_dim // per_word
    bits = 8 * itemsize // pack
    mask = (1 << bits) - 1

    def fused_ids_gather(tokens, query_start_loc, context, params, eos, table, row_start, scale,
                         write_ids, ids_out, out, scales, scale_column, total_rows, bad):
        staged = cuda.shared.array(shape, int64)
        lane = cuda.threadIdx.x
        first = cuda.blockIdx.x * block
        count = stage_block(tokens, query_start_loc, context, params, eos, ngram_size,
                            heads_per_ngram, heads, first, lane, block, staged, write_ids,
                            ids_out)
        rows = table.shape[0]
        for flat in range(lane, count * heads * words, block):
            row, head, word = locate(flat, words, heads)
            local = staged[row, head] - row_start
            inside = 0 <= local < rows
            if not inside and word == 0:
                note_bad_id(bad, total_rows, staged[row, head], (first + row) * heads + head)
            packed = uint64(table[local, word]) if inside else uint64(0)
            if blocked:
                store_blocked_word(packed, inside, per_word, bits, mask, code, scale, out_code,
                                   out, first + row, head * head_dim + word * per_word, scales,
                                   scale_column, local, word * per_word, values_per_scale)
            else:
                store_word(packed, inside, per_word, bits, mask, code, scale, out_code, out,
                           first + row, head * head_dim + word * per_word)

    def fused_tiered_ids_gather(tokens, query_start_loc, context, params, eos, table, row_start,
                                scale, write_ids, ids_out, out, hot_words, hot_ranks, hot,
                                counts, scales, hot_scales, scale_column, total_rows, bad):
        staged = cuda.shared.array(shape, int64)
        lane = cuda.threadIdx.x
        first = cuda.blockIdx.x * block
        count = stage_block(tokens, query_start_loc, context, params, eos, ngram_size,
                            heads_per_ngram, heads, first, lane, block, staged, write_ids,
                            ids_out)
        rows = table.shape[0]
        counter = cuda.blockIdx.x % counts.shape[0]
        for flat in range(lane, count * heads * words, block):
            row, head, word = locate(flat, words, heads)
            local = staged[row, head] - row_start
            inside = 0 <= local < rows
            if not inside and word == 0:
                note_bad_id(bad, total_rows, staged[row, head], (first + row) * heads + head)
            packed = uint64(0)
            slot = int64(-1)
            if inside:
                slot = hot_slot(hot_words, hot_ranks, local)
                if word == 0:  # each row read counted once, in its tier
                    cuda.atomic.add(counts, (counter, 0 if slot >= 0 else 1), uint64(1))
                packed = uint64(hot[slot, word]) if slot >= 0 else uint64(table[local, word])
            if blocked:
                store_blocked_word(packed, inside, per_word, bits, mask, code, scale, out_code,
                                   out, first + row, head * head_dim + word * per_word,
                                   hot_scales if slot >= 0 else scales, scale_column,
                                   slot if slot >= 0 else local, word * per_word,
                                   values_per_scale)
            else:
                store_word(packed, inside, per_word, bits, mask, code, scale, out_code, out,
                           first + row, head * head_dim + word * per_word)

    return NumbaKernel(fused_tiered_ids_gather if tiered else fused_ids_gather), block


def launch_fused(layout, tokens, query_start_loc, context, params, table_words, code: int,
                 row_start: int, scale, write_ids: bool, ids_out, out, out_code: int, stream=None,
                 block: int | None = None, hot=None, counts=None, scales=None, hot_scales=None,
                 total_rows: int | None = None, bad=None, scale_column: int = 0):
    """Launch on device arrays (simulator arrays in tests).

    ``table_words`` is the table as ``[rows, words]`` unsigned words (see ``word_bytes``),
    ``out`` the raw ``[T, H * head_dim]`` output; the ids are written to ``ids_out`` (``[T, H]``
    int64) when ``write_ids``, else ``ids_out`` is any int64 placeholder. With ``hot = ((words,
    ranks), hot rows)`` (the slot map, see ``hot_rows``, and the hot rows as words of the
    table's width) hot rows are read from the hot rows and each row read is counted in
    ``counts`` (uint64 ``[COUNTER_LANES, 2]``: hot, cold), as the tiered gather does. A
    block-scaled table's rows come with their uint8 block ``scales`` (and the hot rows' with
    ``hot_scales``), read from byte column ``scale_column`` (packed records: see
    ``fused_kernel``). With ``total_rows`` and ``bad`` (uint64 ``[1]``,
    ``row_ids.NO_BAD_WORD``), the position of the first id outside ``[0, total_rows)`` is noted
    in ``bad``.
    """
    num_tokens = tokens.shape[0]
    placeholder = table_words.view(np.uint8)  # never read: only block-scaled kernels read scales
    require_block_scales(FORMATS[code], scales, hot, hot_scales)
    if num_tokens:
        head_dim = out.shape[1] // layout.num_heads
        kernel, block = fused_kernel(layout.ngram_size, layout.heads_per_ngram, head_dim, code,
                                     out_code, block, table_words.dtype.itemsize,
                                     hot is not None)
        args = (tokens, query_start_loc, context, params, np.int64(layout.eos_token_id),
                table_words, np.int64(row_start), np.float32(scale), np.bool_(write_ids),
                ids_out, out)
        if hot is not None:
            (words, ranks), hot_words = hot
            if hot_words.dtype != table_words.dtype:
                raise ValueError(f"the hot rows must be words of the table's width "
                                 f"({table_words.dtype}), got {hot_words.dtype}")
            args += (words, ranks, hot_words, counts)
        args += (placeholder if scales is None else scales,)
        if hot is not None:
            args += (placeholder if hot_scales is None else hot_scales,)
        args += (np.int64(scale_column),)
        checked = total_rows is not None and bad is not None
        args += (np.int64(total_rows if checked else UNCHECKED),
                 bad if checked else unchecked_word(table_words))
        kernel(-(-num_tokens // block), block, args, stream)
    return out


def unchecked_word(like):
    """The ``bad`` argument of a launch that checks no ids (never read nor written): NumPy for
    NumPy arrays (the simulator), else one CuPy word per GPU, made once."""
    if isinstance(like, np.ndarray):
        return np.full(1, NO_BAD_WORD, np.uint64)
    return device_unchecked_word(like.device.id)


@cache
def device_unchecked_word(device: int):
    """``unchecked_word`` of one GPU."""
    cupy = cupy_module()
    with cupy.cuda.Device(device):
        return cupy.full(1, NO_BAD_WORD, np.uint64)


def table_words(rows, itemsize: int, *also, values: int | None = None):
    """A raw C-contiguous ``[rows, n]`` table viewed as ``[rows, words]`` unsigned words, as
    wide as the row size, the bytes of each row's values the kernel reads (``values``, default
    the whole row: less for packed records) and the table's address (and those of ``also``, raw
    arrays of the same rows' shape read with the same words: a hot tier) all allow."""
    address = data_address(rows)
    for other in also:
        address |= data_address(other)
    row_bytes = rows.shape[1] * itemsize
    width = word_bytes(gcd(row_bytes, row_bytes if values is None else values), itemsize,
                       address)
    return rows.view(np.dtype(f"u{width}"))


@cache
def placeholder_ids(device: int):
    """An int64 placeholder for ``ids_out`` on ``device``, made once (and waited for)."""
    cupy = cupy_module()
    with cupy.cuda.Device(device):
        array = cupy.zeros((1, 1), dtype=np.int64)
        cupy.cuda.get_current_stream().synchronize()
    return array


# The bad-id words of fused lookups whose caller passes no table's (``bad_ids``), by the
# rows' address and row count: one table's bad id is never raised in another table's call.
UNOWNED_BAD_IDS: dict[tuple[int, int], BadIds] = {}


def unowned_bad_ids(rows, total_rows: int) -> BadIds:
    """The bad-id words of fused lookups of ``rows`` (``total_rows`` of them) by a caller that
    passes no table's ``bad_ids``."""
    return UNOWNED_BAD_IDS.setdefault((data_address(rows), int(total_rows)), BadIds())


def fused_lookup_cuda(layout, rows, fmt: Format, row_start: int, scale, tokens, query_start_loc,
                      context, out, out_code: int, ids_out, stream, tier=None, scales=None,
                      total_rows: int | None = None, bad_ids: BadIds | None = None):
    """Fused ids + gather on checked, contiguous CuPy arrays, on the CuPy ``stream``, with no
    host synchronisation.

    ``rows`` is the table's raw ``[rows, head_dim]`` CuPy view (``EmbeddingTable.device_rows``)
    of format ``fmt``, holding global rows from ``row_start``; ``scale`` its scale or None;
    ``out`` the raw output array; ``ids_out`` an int64 ``[T, H]`` CuPy array or None. ``tier``:
    a hot tier over ``rows`` (``TieredStorage.device_tier``: slot map, raw hot rows, counters,
    hot block scales), or None. ``scales``: a block-scaled table's block scales beside ``rows``
    (rows and scales that are views into packed records are read as the whole records).
    With ``total_rows``, a hashed id outside ``[0, total_rows)`` (a layout that does not match
    the table) is noted in ``bad_ids`` (the table's ``EmbeddingTable.bad_ids``; default: the words
    of ``rows``, ``unowned_bad_ids``) and raised as the table's lookups raise
    theirs (``tables.bad_ids``): a bad id noted earlier surfaces here, before this launch.
    """
    device = out.device.id
    write_ids = ids_out is not None
    if not write_ids:
        ids_out = placeholder_ids(device)
    tables = kernel_tables(rows, fmt.itemsize, scales, tier)
    bad = None
    if total_rows is not None:
        bad_ids = unowned_bad_ids(rows, total_rows) if bad_ids is None else bad_ids
        bad_ids.poll(total_rows, stream)
        bad = bad_ids.word(device, stream)
    launch_fused(layout, tokens, query_start_loc, context, device_params(layout, device),
                 code=fmt.code, row_start=row_start, scale=1.0 if scale is None else scale,
                 write_ids=write_ids, ids_out=ids_out, out=out, out_code=out_code,
                 stream=stream, total_rows=total_rows, bad=bad, **tables)
    if bad is not None:
        bad_ids.noted(device, stream)
    return out


def kernel_tables(rows, itemsize: int, scales=None, tier=None) -> dict:
    """``launch_fused``'s table arguments (``table_words``, ``scales``, ``hot``, ``counts``,
    ``hot_scales``, ``scale_column``) for raw ``rows`` (and their block ``scales``) as a
    storage holds them, with ``tier`` (``DeviceTier``) or None: rows and scales that are views
    into packed records are passed as the whole records (``whole_records``), read as words
    as wide as the rows' values, the records and the addresses allow."""
    values = rows.shape[1] * itemsize
    rows, scales, column = whole_records(rows, scales)
    tables = {"scales": scales, "scale_column": column}
    if tier is None:
        tables["table_words"] = table_words(rows, itemsize, values=values)
        return tables
    hot_rows, tables["hot_scales"], _ = whole_records(tier.rows, tier.scales)
    words = tables["table_words"] = table_words(rows, itemsize, hot_rows, values=values)
    tables["hot"], tables["counts"] = (tier.map, hot_rows.view(words.dtype)), tier.counts
    return tables
