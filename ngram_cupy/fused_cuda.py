"""Ids and rows in one launch: the n-gram ids kernel fused with the table gather (Numba CUDA).

Each block hashes its tokens into shared memory exactly as ``ids_cuda`` does (the same
``hashing.stage_token_ids``), optionally stores the ids, and then gathers and dequantises the rows
of those ids (``dequant.convert``) with coalesced word loads, so the ids never make a round trip
through global memory. The load width divides the row and the table's address alike: a table
adopted from an offset view is read in narrower words rather than faulting on a misaligned load.
The simulator runs this very kernel in CI against the CPU path.
"""

from __future__ import annotations

from functools import cache

import numpy as np
from numba import cuda, int64, uint64

from .backends import cupy_module
from .cuda_launch import NumbaKernel
from .dequant import convert
from .formats import FORMATS, Format
from .gather_cupy import data_address
from .hashing import clamp, stage_token_ids
from .ids_cuda import device_params, staging_shape

WORD_BYTES = (8, 4, 2, 1)


def word_bytes(row_bytes: int, itemsize: int, address: int = 0) -> int:
    """The widest word (<= 8 bytes, >= one value) that tiles a row and that the table's
    ``address`` is aligned to, so that every load is aligned: one load per word."""
    return next(w for w in WORD_BYTES
                if w >= itemsize and row_bytes % w == 0 and address % w == 0)


@cache
def fused_kernel(ngram_size: int, heads_per_ngram: int, head_dim: int, code: int, out_code: int,
                 block: int | None = None, word: int | None = None):
    """``(kernel, tokens per block)`` for one layer shape and (storage, output) format pair.

    Table rows are read as ``[rows, words]`` unsigned words of ``word`` bytes (default: the
    widest that tiles a row, for an aligned table).
    """
    heads = (ngram_size - 1) * heads_per_ngram
    shape = staging_shape(heads, block)
    block = shape[0]
    itemsize = FORMATS[code].itemsize
    word = word_bytes(head_dim * itemsize, itemsize) if word is None else word
    per_word = word // itemsize
    words = head_dim // per_word
    bits = 8 * itemsize
    mask = (1 << bits) - 1

    def fused_ids_gather(tokens, query_start_loc, context, params, eos, table, row_start, scale,
                     write_ids, ids_out, out):
        staged = cuda.shared.array(shape, int64)
        lane = cuda.threadIdx.x
        first = cuda.blockIdx.x * block
        stage_token_ids(tokens, query_start_loc, context, params, eos, ngram_size,
                        heads_per_ngram, first + lane, staged, lane)
        cuda.syncthreads()
        count = clamp(tokens.shape[0] - first, 0, block)
        if write_ids:  # the caller wants the ids too
            for flat in range(lane, count * heads, block):
                row = flat // heads
                head = flat - row * heads
                ids_out[first + row, head] = staged[row, head]
        rows = table.shape[0]
        for flat in range(lane, count * heads * words, block):
            item = flat // words
            word = flat - item * words
            row = item // heads
            head = item - row * heads
            local = staged[row, head] - row_start
            column = head * head_dim + word * per_word
            if 0 <= local < rows:
                packed = uint64(table[local, word])
                for k in range(per_word):
                    value = (packed >> uint64(k * bits)) & uint64(mask)
                    out[first + row, column + k] = convert(value, code, scale, out_code)
            else:
                for k in range(per_word):
                    out[first + row, column + k] = 0

    return NumbaKernel(fused_ids_gather), block


def launch_fused(layout, tokens, query_start_loc, context, params, table_words, code: int,
                 row_start: int, scale, write_ids: bool, ids_out, out, out_code: int, stream=None,
                 block: int | None = None):
    """Launch on device arrays (simulator arrays in tests).

    ``table_words`` is the table as ``[rows, words]`` unsigned words (see ``word_bytes``),
    ``out`` the raw ``[T, H * head_dim]`` output; the ids are written to ``ids_out`` (``[T, H]``
    int64) when ``write_ids``, else ``ids_out`` is any int64 placeholder.
    """
    num_tokens = tokens.shape[0]
    if num_tokens:
        head_dim = out.shape[1] // layout.num_heads
        kernel, block = fused_kernel(layout.ngram_size, layout.heads_per_ngram, head_dim, code,
                                     out_code, block, table_words.dtype.itemsize)
        kernel(-(-num_tokens // block), block,
               (tokens, query_start_loc, context, params, np.int64(layout.eos_token_id),
                table_words, np.int64(row_start), np.float32(scale), np.bool_(write_ids),
                ids_out, out),
               stream)
    return out


def table_words(rows, itemsize: int):
    """A raw ``[rows, head_dim]`` table viewed as ``[rows, words]`` unsigned words, as wide as
    the row size and the table's address both allow."""
    width = word_bytes(rows.shape[1] * itemsize, itemsize, data_address(rows))
    return rows.view(np.dtype(f"u{width}"))


@cache
def placeholder_ids(device: int):
    """An int64 placeholder for ``ids_out`` on ``device`` (the current one), made once."""
    return cupy_module().zeros((1, 1), dtype=np.int64)


def fused_lookup_cuda(layout, rows, fmt: Format, row_start: int, scale, tokens, query_start_loc,
                      context, out, out_code: int, ids_out, stream):
    """Fused ids + gather on checked, contiguous CuPy arrays, on the CuPy ``stream``.

    ``rows`` is the table's raw ``[rows, head_dim]`` CuPy view (``EmbeddingTable.device_rows``)
    of format ``fmt``, holding global rows from ``row_start``; ``scale`` its scale or None;
    ``out`` the raw output array; ``ids_out`` an int64 ``[T, H]`` CuPy array or None.
    """
    device = out.device.id
    write_ids = ids_out is not None
    if not write_ids:
        ids_out = placeholder_ids(device)
    words = table_words(rows, fmt.itemsize)
    return launch_fused(layout, tokens, query_start_loc, context, device_params(layout, device),
                        words, fmt.code, row_start, 1.0 if scale is None else scale, write_ids,
                        ids_out, out, out_code, stream)
