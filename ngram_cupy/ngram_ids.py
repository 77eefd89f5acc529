"""Public entry points for n-gram ids and context rolling (SPEC sections 2 and 3)."""

from __future__ import annotations

import numpy as np

from .arrays import convert
from .checks import check_batch, check_layout, check_out, check_query_start_loc_values
from .ids_numba import advance_context_numba, ngram_ids_numba
from .layout import LayerLayout


def _host_batch(layout: LayerLayout, input_ids, query_start_loc, ngram_context):
    """Contiguous NumPy views of a checked batch, plus ``(T, R)``."""
    check_layout(layout)
    _, arrays = convert(input_ids=input_ids, query_start_loc=query_start_loc,
                        ngram_context=ngram_context)
    input_ids, query_start_loc, ngram_context = (
        np.ascontiguousarray(arrays[name])
        for name in ("input_ids", "query_start_loc", "ngram_context")
    )
    num_tokens, num_requests = check_batch(layout, input_ids, query_start_loc, ngram_context)
    check_query_start_loc_values(query_start_loc, num_tokens)
    return input_ids, query_start_loc, ngram_context, num_tokens, num_requests


def compute_ngram_ids(layout: LayerLayout, input_ids, query_start_loc, ngram_context,
                      out=None) -> np.ndarray:
    """Row ids ``[T, num_heads]`` (int64) of every token of a packed batch of requests.

    ``input_ids[T]`` holds the requests' tokens back to back, ``query_start_loc[R+1]`` where each
    starts, and ``ngram_context[R' >= R, ngram_size-1]`` the tokens before each request (oldest
    first; all EOS for a fresh sequence). Bit-exact with the reference model on any input.
    """
    tokens, starts, context, num_tokens, _ = _host_batch(
        layout, input_ids, query_start_loc, ngram_context
    )
    shape = (num_tokens, layout.num_heads)
    if out is None:
        out = np.empty(shape, dtype=np.int64)
    else:
        check_out("out", out, shape, np.int64)
    return ngram_ids_numba(layout, tokens, starts, context, out)


def advance_context(layout: LayerLayout, input_ids, query_start_loc, ngram_context,
                    out=None) -> np.ndarray:
    """Each request's next ``[R, ngram_size-1]`` context: the last n-1 of context ++ tokens.

    ``out`` may be ``ngram_context`` itself (or its first R rows) to roll a persistent buffer in
    place.
    """
    tokens, starts, context, _, num_requests = _host_batch(
        layout, input_ids, query_start_loc, ngram_context
    )
    shape = (num_requests, layout.ngram_size - 1)
    if out is None:
        out = np.empty(shape, dtype=context.dtype)
    else:
        check_out("out", out, shape, context.dtype)
    return advance_context_numba(tokens, starts, context, out)
