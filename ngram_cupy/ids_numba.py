"""The fast CPU path for n-gram ids: one pass over the tokens, parallel over blocks of tokens."""

from __future__ import annotations

import hashlib
import inspect
from functools import cache

import numpy as np
from numba import njit, prange
from numba.core.extending import register_jitable

from . import hashing
from .hashing import write_token_ids

# Numba's on-disk cache only watches this file; the kernels' closure carries a digest of the
# shared arithmetic too, so editing hashing.py can never reuse stale machine code.
HASHING_DIGEST = int.from_bytes(hashlib.sha256(inspect.getsource(hashing).encode()).digest()[:7],
                                "little")

# Tokens per parallel work item: large enough to amortise the request search, small enough to
# balance a single long request across every core.
BLOCK = 2048
# Below this many tokens a thread pool costs more than it saves (decode batches).
PARALLEL_MIN_TOKENS = 16384


@cache
def _ids_kernels(ngram_size: int, heads_per_ngram: int, digest: int = HASHING_DIGEST):
    """Serial and parallel id kernels compiled for one ``(ngram_size, heads_per_ngram)``.

    Both are constants of the closure, so the per-order and per-head loops unroll fully; Numba
    caches one machine-code entry per pair (and per ``digest`` of hashing.py) on disk.
    """

    def kernel(tokens, query_start_loc, context, multipliers, sizes, magics, offsets, eos, out):
        num_tokens = tokens.shape[0] + (digest & 0)  # digest: part of the cache key only
        for block in prange((num_tokens + BLOCK - 1) // BLOCK):
            first = block * BLOCK
            request = np.searchsorted(query_start_loc, first, side="right") - 1
            for t in range(first, min(first + BLOCK, num_tokens)):
                while t >= query_start_loc[request + 1]:
                    request += 1
                write_token_ids(tokens, context, request, query_start_loc[request], t,
                                ngram_size, heads_per_ngram, eos, multipliers, sizes, magics,
                                offsets, out, t)

    serial = njit(cache=True, nogil=True)(kernel)
    parallel = njit(cache=True, nogil=True, parallel=True)(kernel)
    return serial, parallel


def ngram_ids_numba(layout, tokens, query_start_loc, context, out, parallel: bool | None = None):
    """Write the ids of validated, contiguous NumPy inputs into ``out`` with the Numba kernel.

    ``parallel=None`` uses threads only for batches large enough to repay them.
    """
    serial_kernel, parallel_kernel = _ids_kernels(layout.ngram_size, layout.heads_per_ngram)
    if parallel is None:
        parallel = tokens.shape[0] >= PARALLEL_MIN_TOKENS
    kernel = parallel_kernel if parallel else serial_kernel
    kernel(tokens, query_start_loc, context, layout.multipliers, layout.head_sizes,
           layout.head_magics, layout.head_offsets, layout.eos_token_id, out)
    return out


@register_jitable(inline="always")
def roll_context_row(tokens, context, request, start, end, out):
    """``out[request]``: the last ``out.shape[1]`` of ``context[request] ++ tokens[start:end]``.

    Safe in place (``out`` aliasing ``context``): each entry reads at or after the one it writes.
    Shared with the GPU kernel.
    """
    width = out.shape[1]
    for i in range(width):
        position = end - width + i
        if position >= start:
            out[request, i] = tokens[position]
        else:
            out[request, i] = context[request, i + (end - start)]


@njit(cache=True, nogil=True)
def advance_context_numba(tokens, query_start_loc, context, out):
    """Roll each request's context over its tokens: the last n-1 of ``context[r] ++ tokens_r``."""
    for r in range(out.shape[0]):
        roll_context_row(tokens, context, r, query_start_loc[r], query_start_loc[r + 1], out)
    return out
