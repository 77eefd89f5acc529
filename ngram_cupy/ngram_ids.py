"""Public entry points for n-gram ids and context rolling (SPEC sections 2 and 3).

NumPy arguments (or torch CPU tensors, viewed zero-copy) run the Numba CPU kernels and give NumPy
results; CuPy arrays, CUDA torch tensors and other CUDA arrays run the Numba CUDA kernels on the
caller's stream and give CuPy results (``torch.from_dlpack`` takes them without a copy).
"""

from __future__ import annotations

import numpy as np

from .arrays import place
from .checks import (
    check_batch,
    check_destination,
    check_layout,
    check_out,
    check_query_start_loc_values,
)
from .ids_numba import advance_context_numba, ngram_ids_numba
from .layout import LayerLayout


def _batch(layout: LayerLayout, stream, input_ids, query_start_loc, ngram_context, out):
    """Checked, contiguous arrays of one call on its side: ``(stream, arrays, out, T, R)``.

    ``stream`` is None on the host. On the GPU only shapes are checked: reading
    ``query_start_loc`` would synchronise with the device, and the kernels clamp it instead.
    """
    check_layout(layout)
    check_destination("out", out)
    stream, arrays = place(stream, input_ids=input_ids, query_start_loc=query_start_loc,
                           ngram_context=ngram_context, out=out)
    names = ("input_ids", "query_start_loc", "ngram_context")
    # Checked before ascontiguousarray, which would turn a 0-d array into a 1-D one.
    num_tokens, num_requests = check_batch(layout, *(arrays[name] for name in names))
    if stream is None:
        batch = tuple(np.ascontiguousarray(arrays[name]) for name in names)
        check_query_start_loc_values(batch[1], num_tokens)
    else:
        if num_requests == 0 and num_tokens:
            raise ValueError(
                f"query_start_loc holds no request but input_ids has {num_tokens} tokens")
        import cupy

        with stream:
            batch = tuple(cupy.ascontiguousarray(arrays[name]) for name in names)
    return stream, batch, arrays["out"], num_tokens, num_requests


def _output(stream, out, shape: tuple[int, int], dtype):
    """``out`` checked, or a new array on the call's side (allocated for the call's stream)."""
    if out is not None:
        check_out("out", out, shape, dtype)
        return out
    if stream is None:
        return np.empty(shape, dtype=dtype)
    import cupy

    with stream:
        return cupy.empty(shape, dtype=dtype)


def compute_ngram_ids(layout: LayerLayout, input_ids, query_start_loc, ngram_context,
                      out=None, *, stream=None):
    """Row ids ``[T, num_heads]`` (int64) of every token of a packed batch of requests.

    ``input_ids[T]`` holds the requests' tokens back to back, ``query_start_loc[R+1]`` where each
    starts, and ``ngram_context[R' >= R, ngram_size-1]`` the tokens before each request (oldest
    first; all EOS for a fresh sequence). Bit-exact with the reference model on any input.
    GPU arrays run one kernel on ``stream`` (default: CuPy's current stream; a CuPy or torch
    stream), with no host synchronisation; there ``query_start_loc`` is trusted, not checked.
    """
    stream, (tokens, starts, context), out, num_tokens, _ = _batch(
        layout, stream, input_ids, query_start_loc, ngram_context, out
    )
    out = _output(stream, out, (num_tokens, layout.num_heads), np.int64)
    if stream is None:
        return ngram_ids_numba(layout, tokens, starts, context, out)
    from .ids_cuda import ngram_ids_cuda

    with out.device:
        return ngram_ids_cuda(layout, tokens, starts, context, out, stream)


def advance_context(layout: LayerLayout, input_ids, query_start_loc, ngram_context,
                    out=None, *, stream=None):
    """Each request's next ``[R, ngram_size-1]`` context: the last n-1 of context ++ tokens.

    ``out`` may be ``ngram_context`` itself (or its first R rows) to roll a persistent buffer in
    place. GPU arrays run one kernel on ``stream``, as in ``compute_ngram_ids``.
    The result's dtype holds both inputs' (``numpy.result_type``): int64 tokens rolled into an
    int32 context give an int64 context, never a truncated token; ``out`` must have that dtype.
    """
    stream, (tokens, starts, context), out, _, num_requests = _batch(
        layout, stream, input_ids, query_start_loc, ngram_context, out
    )
    dtype = np.result_type(context.dtype, tokens.dtype)
    out = _output(stream, out, (num_requests, layout.ngram_size - 1), dtype)
    if stream is None:
        return advance_context_numba(tokens, starts, context, out)
    from .ids_cuda import advance_context_cuda

    with out.device:
        return advance_context_cuda(tokens, starts, context, out, stream)
