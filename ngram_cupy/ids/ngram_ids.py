"""Public entry points for n-gram ids and context rolling (docs/ids.md).

NumPy arguments (or torch CPU tensors, viewed zero-copy) run the Numba CPU kernels; CuPy arrays,
CUDA torch tensors and other CUDA arrays run the Numba CUDA kernels on the caller's stream.
Results follow the inputs (``backends``): NumPy for NumPy, CuPy for CuPy, torch for torch, and a
given ``out`` is what is returned. A batch padded to a CUDA-graph size (``input_ids`` longer than
``query_start_loc[R]``) gives its padded tokens vLLM's ids, those of tokens appended to
the last request; ``advance_context`` ignores them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..hashing.layout import LayerLayout, check_layout
from ..runtime.backends import HOST, Call, bind
from ..runtime.checks import check_destination, check_out
from ..runtime.jitable import read_only
from .batch import check_batch, check_query_start_loc_values
from .batched import is_row_batch, pack_rows, require_packed
from .ids_numba import advance_context_numba, ngram_ids_numba


@dataclass
class Batch:
    """One packed batch, checked and contiguous on its side: the bound call (side, stream,
    ``out``), the three arrays, and the token and request counts."""

    call: Call
    tokens: Any
    query_start_loc: Any
    context: Any
    num_tokens: int
    num_requests: int


def bind_batch(layout: LayerLayout, stream, input_ids, query_start_loc, ngram_context,
               **outs) -> Batch:
    """Bind and check one packed batch (and its ``out`` arrays, by name).

    On the GPU only shapes are checked: reading ``query_start_loc`` would synchronise with the
    device, and the kernels clamp it instead.
    """
    check_layout(layout)
    for name, value in outs.items():
        check_destination(name, value)
    call = bind(stream, input_ids=input_ids, query_start_loc=query_start_loc,
                ngram_context=ngram_context, **outs)
    names = ("input_ids", "query_start_loc", "ngram_context")
    # Checked before making contiguous, which would turn a 0-d array into a 1-D one.
    num_tokens, num_requests = check_batch(layout, *(call[name] for name in names))
    with call.on():
        arrays = tuple(call.side.contiguous(call[name]) for name in names)
    if call.side is HOST:
        check_query_start_loc_values(arrays[1], num_tokens)
    return Batch(call, *arrays, num_tokens, num_requests)


def output(call: Call, shape: tuple[int, ...], dtype, name: str = "out"):
    """The call's ``name`` array checked, or a new array on the call's side (allocated for the
    call's stream)."""
    out = call[name]
    if out is not None:
        check_out(name, out, shape, dtype)
        return out
    with call.on():
        return call.side.empty(shape, dtype)


def compute_ngram_ids(layout: LayerLayout, input_ids, query_start_loc=None, ngram_context=None,
                      out=None, *, stream=None):
    """Row ids ``[T, num_heads]`` (int64) of every token of a packed batch of requests,
    bit-exact with the reference model on any input.

    Args:
        layout: the PLE layer's :class:`~ngram_cupy.LayerLayout` (``layer_layout(config,
            layer)``).
        input_ids: ``[T]`` integer tokens of the requests back to back (tokens outside
            ``[0, vocab_size)`` are hashed as the model hashes them, not refused); or
            ``[B, S]``: B sequences, one per row, with ``query_start_loc=None``, giving
            ``[B, S, num_heads]``. NumPy, CuPy, torch (CPU or CUDA) or DLPack arrays.
        query_start_loc: ``[R + 1]`` offsets: request ``r`` owns tokens
            ``[query_start_loc[r], query_start_loc[r + 1])``; tokens past the last offset are
            padding and get vLLM 0.33's ids. Required for 1-D ``input_ids``.
        ngram_context: ``[R' >= R, ngram_size - 1]`` tokens before each request, oldest
            first (all EOS for a fresh sequence); for ``[B, S]`` input ``[B, n - 1]`` or None
            (default: all EOS).
        out: an int64 array of the result's shape on the inputs' side to write into
            (default None: allocated); it is what is returned.
        stream: GPU only: a CuPy or torch stream; default None: torch's current stream for
            torch inputs, else CuPy's. One kernel, no host synchronisation; on the GPU
            ``query_start_loc`` is trusted, not checked.

    Returns:
        int64 ids in the inputs' framework and device: ``[T, num_heads]`` (``[B, S,
        num_heads]`` for row batches).

    Raises:
        ValueError / TypeError naming the argument (host inputs: offsets not increasing or
        past ``T``, a context of the wrong shape, mixed host and device arrays).
    """
    if is_row_batch(input_ids):
        call, packed, shape = pack_rows(layout, input_ids, query_start_loc, ngram_context, out,
                                        stream=stream)
        return call.result(compute_ngram_ids(layout, *packed, stream=call.stream).reshape(shape))
    require_packed(input_ids, query_start_loc, ngram_context)
    batch = bind_batch(layout, stream, input_ids, query_start_loc, ngram_context, out=out)
    return batch.call.result(batch_ids(layout, batch, output(
        batch.call, (batch.num_tokens, layout.num_heads), np.int64)))


def batch_ids(layout: LayerLayout, batch: Batch, out):
    """Write the ids of a bound batch into ``out`` (an array on its side, checked) and return
    it: the Numba kernel on the host, the CUDA kernel on the batch's stream on the GPU."""
    if batch.call.side is HOST:
        return ngram_ids_numba(layout, batch.tokens, batch.query_start_loc, batch.context, out)
    from .ids_cuda import ngram_ids_cuda

    with out.device:
        return ngram_ids_cuda(layout, batch.tokens, batch.query_start_loc, batch.context, out,
                              batch.call.stream)


def advance_context(layout: LayerLayout, input_ids, query_start_loc, ngram_context,
                    out=None, *, stream=None):
    """Each request's next ``[R, ngram_size-1]`` context: the last n-1 of context ++ tokens
    (padded tokens past ``query_start_loc[R]`` belong to no request and are ignored).

    ``out`` may be ``ngram_context`` itself (or its first R rows) to roll a persistent buffer in
    place. GPU arrays run one kernel on ``stream``, as in ``compute_ngram_ids``.
    The result's dtype holds both inputs' (``numpy.result_type``): int64 tokens rolled into an
    int32 context give an int64 context, never a truncated token; ``out`` must have that dtype.
    """
    batch = bind_batch(layout, stream, input_ids, query_start_loc, ngram_context, out=out)
    call = batch.call
    rolled = output(call, (batch.num_requests, layout.ngram_size - 1),
                    np.result_type(batch.context.dtype, batch.tokens.dtype))
    if call.side is HOST:
        advance_context_numba(read_only(batch.tokens), batch.query_start_loc, batch.context,
                              rolled)
    else:
        from .ids_cuda import advance_context_cuda

        with rolled.device:
            advance_context_cuda(batch.tokens, batch.query_start_loc, batch.context, rolled,
                                 call.stream)
    return call.result(rolled)
