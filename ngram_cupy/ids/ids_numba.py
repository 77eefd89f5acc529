"""The fast CPU path for n-gram ids: one pass over the tokens, parallel over blocks of tokens."""

from __future__ import annotations

from functools import cache

import numpy as np
from numba import njit, prange

from ..hashing import arithmetic
from ..hashing.arithmetic import roll_context_row, write_token_ids
from ..runtime.cpu_threads import use_threads
from ..runtime.jitable import read_only, source_digest

# Numba's on-disk cache only watches this file; the kernels' closure carries a digest of the
# shared arithmetic too, so editing hashing/arithmetic.py can never reuse stale machine code.
HASHING_DIGEST = source_digest(arithmetic)

# Tokens per parallel work item: large enough to amortise the request search, small enough to
# balance a single long request across every core.
BLOCK = 512
# Below this many tokens a thread pool costs more than it saves (decode batches).
PARALLEL_MIN_TOKENS = 1024
# Below this many, threads wait for a descheduled worker more than they save when every core is
# taken (32 x 512 tokens with both cores busy: 1.28x the one-thread time on threads).
PARALLEL_BUSY_MIN_TOKENS = 1 << 16


@cache
def _ids_kernel(ngram_size: int, heads_per_ngram: int, parallel: bool,
                digest: int = HASHING_DIGEST):
    """The id kernel compiled for one ``(ngram_size, heads_per_ngram)``, threaded or not.

    All are constants of the closure, so the per-order and per-head loops unroll fully. Numba's
    disk cache keys an entry by the code and the closure's values only, not by ``parallel=``, so
    the serial kernel is its own closure (one block: no thread pool, no per-block search);
    ``digest`` ties the entries to hashing/arithmetic.py.
    """
    block_size = BLOCK if parallel else 1 << 62

    def kernel(tokens, query_start_loc, context, multipliers, sizes, magics, offsets, eos, out):
        num_tokens = tokens.shape[0] + (digest & 0)  # digest: part of the cache key only
        last = query_start_loc.shape[0] - 2  # padded tokens (past q[R]) belong to request R-1
        for block in prange((num_tokens + block_size - 1) // block_size):
            first = block * block_size
            request = min(np.searchsorted(query_start_loc, first, side="right") - 1, last)
            for t in range(first, min(first + block_size, num_tokens)):
                while request < last and t >= query_start_loc[request + 1]:
                    request += 1
                write_token_ids(tokens, context, request, query_start_loc[request], t,
                                ngram_size, heads_per_ngram, eos, multipliers, sizes, magics,
                                offsets, out, t)

    return njit(cache=True, nogil=True, parallel=parallel)(kernel)


def ngram_ids_numba(layout, tokens, query_start_loc, context, out, parallel: bool | None = None):
    """Write the ids of validated, contiguous NumPy inputs into ``out`` with the Numba kernel.

    ``parallel=None`` uses threads only for batches large enough to repay them, ``True`` whenever
    the threading layer allows (``cpu_threads.use_threads``), ``False`` never.
    """
    # Request starts and context rows are small: widened to int64 here, so that each kernel is
    # compiled for the token type alone, not for every mix of three index types.
    query_start_loc = np.require(query_start_loc, np.int64, "W")
    context = np.require(context, np.int64, "W")
    tokens = read_only(tokens)  # one kernel for writable and read-only (Arrow) tokens
    min_tokens = PARALLEL_MIN_TOKENS if parallel is None else 0 if parallel else 1 << 62
    with use_threads(tokens.shape[0], min_tokens, PARALLEL_BUSY_MIN_TOKENS) as threaded:
        kernel = _ids_kernel(layout.ngram_size, layout.heads_per_ngram, threaded)
        kernel(tokens, query_start_loc, context, layout.multipliers, layout.head_sizes,
               layout.head_magics, layout.head_offsets, layout.eos_token_id, out)
    return out


@njit(cache=True, nogil=True)
def advance_context_numba(tokens, query_start_loc, context, out):
    """Roll each request's context over its tokens: the last n-1 of ``context[r] ++ tokens_r``."""
    for r in range(out.shape[0]):
        roll_context_row(tokens, context, r, query_start_loc[r], query_start_loc[r + 1], out)
    return out


def compile_kernels(layout, token_dtype, parallel: tuple[bool, ...] = (False,)) -> None:
    """Compile (or load from Numba's cache) the id kernels (serial by default, as the ``ids``
    pipeline runs them) and the context roll for read-only tokens of ``token_dtype`` (zero-copy
    Arrow values), with empty inputs: callers can do it before timing."""
    tokens = np.zeros(0, dtype=token_dtype)
    tokens.flags.writeable = False
    starts = np.zeros(1, dtype=np.int64)
    context = np.zeros((0, layout.ngram_size - 1), dtype=np.int64)
    out = np.zeros((0, layout.num_heads), dtype=np.int64)
    for threaded in parallel:
        ngram_ids_numba(layout, tokens, starts, context, out, threaded)
    advance_context_numba(tokens, starts, context, context)
