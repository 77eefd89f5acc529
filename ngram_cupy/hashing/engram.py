"""Per-token Engram arithmetic (docs/engram.md) shared by the Numba CPU and CUDA kernels.

What differs from Qwen4Exp lives here: compressed sources through the token map, the walk back
by absolute position with a lookback window (newest first) before the chunk, dead tokens and the
sequence start as the barrier, and all layers' ids of a token in one row. Request search and the
floor modulo are Qwen4Exp's (``arithmetic``). Every function is ``inline_jitable``: plain Python
under the CUDA simulator, inlined when compiled.

An absent dead mask or lookback is an array of length 0: it reads as no dead token, and as
unknown (-1) lookback entries.
"""

from __future__ import annotations

from numba import int64, uint64

from ..runtime.jitable import inline_jitable
from .arithmetic import floor_mod


@inline_jitable
def write_engram_ids(tokens, positions, dead, lookback, lookback_dead, token_map, pad, request,
                     chunk_start, first, t, ngram_size, heads_per_ngram, num_layers, multipliers,
                     sizes, magics, offsets, values, out, row):
    """Write the ``L * H`` ids of token ``t`` into ``out[row]``, layer after layer.

    Walking back ``s = 0..n-1`` places to absolute position ``p - s``: the batch's token when
    that lies in the chunk (which begins at position ``chunk_start``), else the request's
    lookback entry (newest first), else (unknown, or beyond the window) the pad id; the walk
    never reads before the chunk's first token ``first`` (positions with a gap, unchecked on
    the GPU, give meaningless ids but none from another request). A dead
    source or a position before 0 blocks it and every older one: they read the pad id. A token
    outside the map reads the pad id too (GPU inputs are not checked), so nothing reads past
    the map. The walk is the same for every layer: it fills ``values[0..n-1]`` (the caller's
    scratch) once. Then order ``s + 1`` of each layer hashes ``XOR_{j<=s} v_j * m[layer, j]``
    (wrapping) into its heads. One exit and no helper taking arrays: Numba then keeps no array
    reference counts in the loop (a branchy helper cost 5x).
    """
    position = int64(positions[t])
    vocab = token_map.shape[0]
    blocked = False
    for shift in range(ngram_size):
        behind = position - shift
        token = int64(-1)
        is_dead = False
        if behind >= chunk_start:
            index = t - shift
            if index < first:
                index = first
            token = int64(tokens[index])
            if dead.shape[0] != 0:
                is_dead = dead[index] != 0
        else:
            column = chunk_start - 1 - behind
            if column < lookback.shape[1] and request < lookback.shape[0]:
                token = int64(lookback[request, column])
                if token >= 0 and lookback_dead.shape[0] != 0:
                    is_dead = lookback_dead[request, column] != 0
        source = int64(pad)
        if token >= 0 and token < vocab:
            source = int64(token_map[token])
        blocked |= behind < 0 or is_dead
        values[shift] = int64(pad) if blocked else source
    heads = (ngram_size - 1) * heads_per_ngram
    for layer in range(num_layers):
        rolling = uint64(values[0]) * uint64(multipliers[layer, 0])
        head = 0
        for shift in range(1, ngram_size):
            rolling ^= uint64(values[shift]) * uint64(multipliers[layer, shift])
            signed = int64(rolling)
            for _ in range(heads_per_ngram):
                reduced = floor_mod(signed, uint64(sizes[layer, head]),
                                    uint64(magics[layer, head]))
                out[row, layer * heads + head] = reduced + offsets[layer, head]
                head += 1


@inline_jitable
def roll_lookback_row(values, lookback, request, start, end, fill, out):
    """``out[request]``: the ``out.shape[1]`` newest of ``lookback[request]`` (newest first)
    followed by ``values[start:end]``, newest first; ``fill`` where neither reaches (no
    ``lookback``: an array of length 0).

    Safe in place (``out`` aliasing ``lookback``): columns are written oldest first, and each
    reads an older-or-equal column ``column - count`` of the row, not yet written.
    """
    width = out.shape[1]
    count = end - start
    for newest in range(width):
        column = width - 1 - newest
        if column < count:
            out[request, column] = values[end - 1 - column]
        elif lookback.shape[0] > request:
            out[request, column] = lookback[request, column - count]
        else:
            out[request, column] = fill
