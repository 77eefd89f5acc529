"""The fast CPU path for Engram ids: one pass over the tokens, all layers per token, parallel
over blocks of tokens (the structure of ``ids_numba``, the arithmetic of docs/engram.md)."""

from __future__ import annotations

from functools import cache

import numpy as np
from numba import njit, prange

from ..hashing import arithmetic, engram
from ..hashing.engram import roll_lookback_row, write_engram_ids
from ..runtime.cpu_threads import use_threads
from ..runtime.jitable import read_only, source_digest
from .ids_numba import BLOCK, PARALLEL_BUSY_MIN_TOKENS, PARALLEL_MIN_TOKENS

# The kernels inline hashing/engram.py and hashing/arithmetic.py: their digest keys the cache.
ENGRAM_DIGEST = source_digest(arithmetic, engram)


def flat_rows(layout, out):
    """``out[T, L, H]`` viewed as ``[T, L * H]``: one row per token, as the kernels write it."""
    return out.reshape(out.shape[0], layout.num_layers * layout.num_heads)


@cache
def _engram_kernel(ngram_size: int, heads_per_ngram: int, num_layers: int, parallel: bool,
                   digest: int = ENGRAM_DIGEST):
    """The kernel for one ``(n, heads per n-gram, layers)``, threaded or not: constants of the
    closure, so the shift, head and layer loops unroll (see ``ids_numba._ids_kernel``)."""
    block_size = BLOCK if parallel else 1 << 62

    def kernel(tokens, positions, query_start_loc, dead, lookback, lookback_dead, token_map,
               pad, multipliers, sizes, magics, offsets, out):
        num_tokens = tokens.shape[0] + (digest & 0)  # digest: part of the cache key only
        for block in prange((num_tokens + block_size - 1) // block_size):
            first = block * block_size
            request = np.searchsorted(query_start_loc, first, side="right") - 1
            values = np.empty(ngram_size, dtype=np.int64)  # one token's walk, reused
            for t in range(first, min(first + block_size, num_tokens)):
                while t >= query_start_loc[request + 1]:
                    request += 1
                chunk_start = positions[query_start_loc[request]]
                write_engram_ids(tokens, positions, dead, lookback, lookback_dead, token_map,
                                 pad, request, chunk_start, query_start_loc[request], t,
                                 ngram_size, heads_per_ngram, num_layers, multipliers, sizes,
                                 magics, offsets, values, out, t)

    return njit(cache=True, nogil=True, parallel=parallel)(kernel)


def engram_ids_numba(layout, tokens, positions, query_start_loc, dead, lookback, lookback_dead,
                     out, parallel: bool | None = None):
    """Write the ids of checked, contiguous NumPy inputs into ``out`` (``[T, L, H]`` int32).

    Dead masks are uint8 (length 0: none), ``lookback`` ``[R', n-1]`` (0 rows: none);
    ``parallel`` as in ``ids_numba.ngram_ids_numba``.
    """
    # Positions, request starts and lookback widened to int64: one compile per token type.
    positions = np.require(positions, np.int64, "W")
    query_start_loc = np.require(query_start_loc, np.int64, "W")
    lookback = np.require(lookback, np.int64, "W")
    min_tokens = PARALLEL_MIN_TOKENS if parallel is None else 0 if parallel else 1 << 62
    with use_threads(tokens.shape[0], min_tokens, PARALLEL_BUSY_MIN_TOKENS) as threaded:
        kernel = _engram_kernel(layout.ngram_size, layout.heads_per_ngram, layout.num_layers,
                                threaded)
        # Read-only views: one kernel for writable and read-only (Arrow, shared) inputs.
        kernel(read_only(tokens), positions, query_start_loc, dead, lookback, lookback_dead,
               read_only(layout.token_map), np.int64(layout.pad_id), layout.multipliers,
               layout.head_sizes, layout.head_magics, layout.head_offsets, flat_rows(layout, out))
    return out


@njit(cache=True, nogil=True)
def advance_engram_lookback_numba(values, query_start_loc, lookback, fill, out):
    """Roll each request's lookback over its values (newest first), ``fill`` where unknown."""
    for r in range(out.shape[0]):
        roll_lookback_row(values, lookback, r, query_start_loc[r], query_start_loc[r + 1], fill,
                          out)
    return out
