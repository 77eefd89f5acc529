"""The GPU path for Engram ids and lookback rolling: Numba CUDA kernels on the caller's stream.

The structure of ``ids_cuda``: one thread hashes one token (all layers, ``hashing.engram``'s
arithmetic) into shared memory, then the block stores its ids as one coalesced run. Nothing is
read back to the host; every index derived from unchecked GPU inputs is clamped, and tokens
outside the map read as the pad id, so bad inputs give meaningless ids but never a read or
write out of bounds. The first call per layout and device uploads its constants.
"""

from __future__ import annotations

from functools import cache

import numpy as np
from numba import cuda, int64

from ..hashing.arithmetic import clamp, find_request
from ..hashing.engram import roll_lookback_row, write_engram_ids
from ..hashing.engram_layout import EngramLayout
from ..runtime.backends import cupy_module
from ..runtime.cuda_launch import NumbaKernel
from .engram_numba import flat_rows
from .ids_cuda import ADVANCE_BLOCK, staging_shape


def engram_params(layout: EngramLayout) -> np.ndarray:
    """``int64 [4, L, max(n, H)]``: multipliers, head sizes, reciprocals (uint64 bits), offsets."""
    n, heads = layout.ngram_size, layout.num_heads
    params = np.zeros((4, layout.num_layers, max(n, heads)), dtype=np.int64)
    params[0, :, :n] = layout.multipliers
    params[1, :, :heads] = layout.head_sizes
    params[2, :, :heads] = layout.head_magics.view(np.int64)
    params[3, :, :heads] = layout.head_offsets
    return params


@cache
def engram_kernel(ngram_size: int, heads_per_ngram: int, num_layers: int,
                  block: int | None = None):
    """``(kernel, tokens per block)`` for one ``(n, heads per n-gram, layers)`` (and block)."""
    width = (ngram_size - 1) * heads_per_ngram * num_layers
    shape = staging_shape(width, block)
    block = shape[0]

    def engram_ids_kernel(tokens, positions, query_start_loc, dead, lookback, lookback_dead,
                          token_map, pad, params, out):
        staged = cuda.shared.array(shape, int64)
        values = cuda.local.array(ngram_size, int64)  # the token's walk
        lane = cuda.threadIdx.x
        first = cuda.blockIdx.x * block
        num_tokens = tokens.shape[0]
        t = first + lane
        if t < num_tokens:
            request = find_request(query_start_loc, t)
            start = clamp(int64(query_start_loc[request]), int64(0), int64(num_tokens - 1))
            write_engram_ids(tokens, positions, dead, lookback, lookback_dead, token_map, pad,
                             request, int64(positions[start]), start, t, ngram_size,
                             heads_per_ngram, num_layers, params[0], params[1], params[2],
                             params[3], values, staged, lane)
        cuda.syncthreads()
        count = clamp(num_tokens - first, 0, block) * width
        for flat in range(lane, count, block):
            row = flat // width
            column = flat - row * width
            out[first + row, column] = staged[row, column]

    return NumbaKernel(engram_ids_kernel), block


def _advance_lookback_kernel(values, query_start_loc, lookback, fill, out):
    """One thread per request rolls its row as the CPU does, so ``out`` may alias ``lookback``."""
    r = cuda.grid(1)
    if r < out.shape[0]:
        end = clamp(int64(query_start_loc[r + 1]), int64(0), int64(values.shape[0]))
        start = clamp(int64(query_start_loc[r]), int64(0), end)
        roll_lookback_row(values, lookback, r, start, end, fill, out)


advance_lookback_kernel = NumbaKernel(_advance_lookback_kernel)


def launch_engram_ids(layout: EngramLayout, tokens, positions, query_start_loc, dead, lookback,
                      lookback_dead, token_map, params, out, stream=None,
                      block: int | None = None):
    """Launch the ids kernel on device arrays (simulator arrays in tests); ``out`` is
    ``[T, L * H]`` int32."""
    num_tokens = tokens.shape[0]
    if num_tokens:
        kernel, block = engram_kernel(layout.ngram_size, layout.heads_per_ngram,
                                      layout.num_layers, block)
        kernel(-(-num_tokens // block), block,
               (tokens, positions, query_start_loc, dead, lookback, lookback_dead, token_map,
                np.int64(layout.pad_id), params, out), stream)
    return out


def launch_advance_lookback(values, query_start_loc, lookback, fill, out, stream=None):
    """Launch the lookback-rolling kernel on device arrays (simulator arrays in tests)."""
    num_requests = out.shape[0]
    if num_requests:
        advance_lookback_kernel(-(-num_requests // ADVANCE_BLOCK), ADVANCE_BLOCK,
                                (values, query_start_loc, lookback, fill, out), stream)
    return out


@cache
def device_constants(layout: EngramLayout, device: int):
    """``(token map, params)`` of the layout on ``device`` (the current one), uploaded once per
    device (the only host synchronisation)."""
    cupy = cupy_module()
    constants = cupy.asarray(layout.token_map), cupy.asarray(engram_params(layout))
    cupy.cuda.get_current_stream().synchronize()  # once: then any stream may read them
    return constants


def engram_ids_cuda(layout: EngramLayout, tokens, positions, query_start_loc, dead, lookback,
                    lookback_dead, out, stream):
    """Write ids of checked, contiguous CuPy arrays into ``out`` (``[T, L, H]``) on ``stream``."""
    token_map, params = device_constants(layout, out.device.id)
    launch_engram_ids(layout, tokens, positions, query_start_loc, dead, lookback, lookback_dead,
                      token_map, params, flat_rows(layout, out), stream)
    return out
