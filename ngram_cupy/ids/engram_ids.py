"""Public entry points for Engram ids and lookback rolling (docs/engram.md).

Arguments bind as for ``compute_ngram_ids``: NumPy (or torch CPU) runs the Numba CPU kernel, CuPy
or CUDA torch the Numba CUDA kernel on the caller's stream; results follow the inputs, and a
given ``out`` is what is returned. On the GPU only shapes and dtypes are checked.
"""

from __future__ import annotations

import numpy as np

from ..hashing.engram_layout import EngramLayout, check_engram_layout
from ..runtime.backends import HOST, Call, bind
from ..runtime.checks import check_destination, check_index_array
from .batch import check_query_start_loc_values
from .engram_numba import advance_engram_lookback_numba, engram_ids_numba
from .ngram_ids import output


def _check_mask(name: str, mask, shape: tuple[int, ...], rows_at_least: bool = False) -> None:
    """A dead mask must be bool with ``shape`` (at least ``shape[0]`` rows if so told)."""
    if np.dtype(mask.dtype) != np.bool_:
        raise TypeError(f"{name} must be a bool array, got {mask.dtype}")
    got = tuple(mask.shape)
    fits = (len(got) == len(shape) and got[1:] == shape[1:]
            and (got[0] >= shape[0] if rows_at_least else got[0] == shape[0]))
    if not fits:
        wanted = f"[R' >= {shape[0]}, {shape[1]}]" if rows_at_least else str(list(shape))
        raise ValueError(f"{name} must have shape {wanted}, got {got}")


def _check_lookback(name: str, lookback, num_requests: int, width: int) -> None:
    """``[R' >= R, n-1]`` int32 / int64."""
    check_index_array(name, lookback, 2)
    if lookback.shape[1] != width or lookback.shape[0] < num_requests:
        raise ValueError(f"{name} must have shape [R' >= {num_requests}, engram_max_ngram_size "
                         f"- 1 = {width}], got {tuple(lookback.shape)}")


def _check_host_values(layout: EngramLayout, tokens, positions, starts, lookback) -> None:
    """Host-side values: tokens inside the map, lookback entries tokens or -1, and positions
    non-negative and consecutive within each request (the walk back is by index)."""
    vocab = layout.vocab_size
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab):
        bad = int(np.flatnonzero((tokens < 0) | (tokens >= vocab))[0])
        raise ValueError(f"input_ids[{bad}]={int(tokens[bad])} is not a token of the tokenizer "
                         f"(ids 0..{vocab - 1})")
    if lookback is not None and lookback.size and (lookback.min() < -1 or lookback.max() >= vocab):
        raise ValueError(f"lookback_token_ids must hold token ids 0..{vocab - 1} or -1 "
                         f"(unknown), got values in [{int(lookback.min())}, "
                         f"{int(lookback.max())}]")
    if positions.size and positions.min() < 0:
        raise ValueError(f"positions must be non-negative, got {int(positions.min())}")
    steps = np.diff(positions.astype(np.int64))
    within = np.ones(steps.size, dtype=bool)
    within[starts[1:-1][(starts[1:-1] > 0) & (starts[1:-1] < positions.size)] - 1] = False
    backwards = np.flatnonzero((steps <= 0) & within)
    if backwards.size:
        t = int(backwards[0]) + 1
        raise ValueError(f"positions must increase within a request: positions[{t}]="
                         f"{int(positions[t])} follows positions[{t - 1}]={int(positions[t - 1])}")
    gaps = np.flatnonzero((steps != 1) & within)
    if gaps.size:
        t = int(gaps[0]) + 1
        request = int(np.searchsorted(starts, t, side="right")) - 1
        raise ValueError(f"positions must be consecutive within a request (a chunk has no gap): "
                         f"request {request} has positions[{t}]={int(positions[t])} after "
                         f"positions[{t - 1}]={int(positions[t - 1])}")


def _bind(layout: EngramLayout, stream, input_ids, positions, query_start_loc, lookback,
          dead_mask, lookback_dead_mask, out) -> tuple[Call, dict]:
    """Bind, check and make contiguous one batch; absent masks and lookback become arrays of
    length 0 (what the kernels read as none)."""
    check_engram_layout(layout)
    check_destination("out", out)
    call = bind(stream, input_ids=input_ids, positions=positions,
                query_start_loc=query_start_loc, lookback_token_ids=lookback,
                dead_mask=dead_mask, lookback_dead_mask=lookback_dead_mask, out=out)
    check_index_array("input_ids", call["input_ids"], 1)
    check_index_array("positions", call["positions"], 1)
    check_index_array("query_start_loc", call["query_start_loc"], 1)
    num_tokens = call["input_ids"].shape[0]
    if call["positions"].shape[0] != num_tokens:
        raise ValueError(f"positions must have one entry per token ({num_tokens}), got "
                         f"{call['positions'].shape[0]}")
    if call["query_start_loc"].shape[0] < 1:
        raise ValueError("query_start_loc must hold at least one entry (0 for an empty batch)")
    num_requests = call["query_start_loc"].shape[0] - 1
    if num_requests == 0 and num_tokens:
        raise ValueError(f"query_start_loc holds no request but input_ids has {num_tokens} tokens")
    width = layout.ngram_size - 1
    if call["lookback_token_ids"] is not None:
        _check_lookback("lookback_token_ids", call["lookback_token_ids"], num_requests, width)
    if call["dead_mask"] is not None:
        _check_mask("dead_mask", call["dead_mask"], (num_tokens,))
    if call["lookback_dead_mask"] is not None:
        if call["lookback_token_ids"] is None:
            raise ValueError("lookback_dead_mask needs lookback_token_ids (without them every "
                             "lookback entry is unknown)")
        _check_mask("lookback_dead_mask", call["lookback_dead_mask"],
                    tuple(call["lookback_token_ids"].shape))
    side = call.side
    with call.on():
        arrays = {name: side.contiguous(call[name]) for name in
                  ("input_ids", "positions", "query_start_loc")}
        lookback = call["lookback_token_ids"]
        arrays["lookback"] = (side.empty((0, width), np.int64) if lookback is None
                              else side.contiguous(lookback))
        for name, shape in (("dead_mask", (0,)), ("lookback_dead_mask", (0, width))):
            mask = call[name]
            arrays[name] = (side.empty(shape, np.uint8) if mask is None
                            else side.contiguous(mask).view(np.uint8))
    if side is HOST:
        check_query_start_loc_values(arrays["query_start_loc"], num_tokens, padded=False)
        _check_host_values(layout, arrays["input_ids"], arrays["positions"],
                           arrays["query_start_loc"], lookback)
    return call, arrays


def compute_engram_ids(layout: EngramLayout, input_ids, positions, query_start_loc,
                       lookback_token_ids=None, dead_mask=None, lookback_dead_mask=None,
                       out=None, *, stream=None):
    """Row ids ``[T, L, H]`` (int32) of every token of a packed batch, all layers in one launch.

    ``input_ids[T]`` raw token ids of R requests back to back, ``positions[T]`` their absolute
    positions, ``query_start_loc[R+1]`` where each request starts; ``lookback_token_ids[R' >= R,
    n-1]`` the raw tokens just before each chunk, newest first (-1 unknown; default: all
    unknown); ``dead_mask[T]`` and ``lookback_dead_mask`` mark tokens that take no part
    (default: none). Bit-exact with docs/engram.md on any input the checks accept.
    """
    call, arrays = _bind(layout, stream, input_ids, positions, query_start_loc,
                         lookback_token_ids, dead_mask, lookback_dead_mask, out)
    shape = (arrays["input_ids"].shape[0], layout.num_layers, layout.num_heads)
    result = output(call, shape, np.int32)
    args = (arrays["input_ids"], arrays["positions"], arrays["query_start_loc"],
            arrays["dead_mask"], arrays["lookback"], arrays["lookback_dead_mask"], result)
    if call.side is HOST:
        engram_ids_numba(layout, *args)
    else:
        from .engram_cuda import engram_ids_cuda

        with result.device:
            engram_ids_cuda(layout, *args[:-1], result, call.stream)
    return call.result(result)


def advance_engram_lookback(layout: EngramLayout, values, query_start_loc, lookback=None,
                            out=None, *, stream=None):
    """Each request's lookback for its next chunk, ``[R, n-1]`` newest first: the newest n-1 of
    its ``values[q_r:q_{r+1}]`` then its ``lookback`` (-1, or False, where unknown).

    ``values`` are the chunk's ``input_ids`` (int32 / int64) or its ``dead_mask`` (bool), rolled
    the same way; ``out`` may be ``lookback`` itself (or its first R rows) to roll a persistent
    buffer in place. The result's dtype holds both inputs' (``numpy.result_type``).
    """
    check_engram_layout(layout)
    check_destination("out", out)
    call = bind(stream, values=values, query_start_loc=query_start_loc, lookback=lookback,
                out=out)
    values, lookback = call["values"], call["lookback"]
    is_mask = np.dtype(values.dtype) == np.bool_
    if not is_mask:
        check_index_array("values", values, 1)
    elif values.ndim != 1:
        raise ValueError(f"values must be 1-D, got shape {tuple(values.shape)}")
    check_index_array("query_start_loc", call["query_start_loc"], 1)
    if call["query_start_loc"].shape[0] < 1:
        raise ValueError("query_start_loc must hold at least one entry (0 for an empty batch)")
    num_requests, width = call["query_start_loc"].shape[0] - 1, layout.ngram_size - 1
    if lookback is not None:
        if is_mask:
            _check_mask("lookback", lookback, (num_requests, width), rows_at_least=True)
        else:
            _check_lookback("lookback", lookback, num_requests, width)
    dtype = np.dtype(values.dtype if lookback is None
                     else np.result_type(values.dtype, lookback.dtype))
    rolled = output(call, (num_requests, width), dtype)
    with call.on():
        values = call.side.contiguous(values)
        starts = call.side.contiguous(call["query_start_loc"])
        lookback = (call.side.empty((0, width), dtype) if lookback is None
                    else call.side.contiguous(lookback))
    fill = np.bool_(False) if is_mask else dtype.type(-1)
    if call.side is HOST:
        check_query_start_loc_values(starts, values.shape[0], padded=False)
        advance_engram_lookback_numba(values, starts, lookback, fill, rolled)
    else:
        from .engram_cuda import launch_advance_lookback

        with rolled.device:
            launch_advance_lookback(values, starts, lookback, fill, rolled, call.stream)
    return call.result(rolled)
