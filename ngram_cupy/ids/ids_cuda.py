"""The GPU path for n-gram ids and context rolling: Numba CUDA kernels on the caller's stream.

The per-token arithmetic is ``hashing.stage_token_ids`` (over ``write_token_ids``), the very code
the CPU path compiles and the CUDA simulator runs in CI. A call is one kernel launch that reads
nothing back to the host and never synchronises, so it can be captured in a CUDA graph. Since
``query_start_loc`` is not checked on the GPU, the kernels clamp every index they derive from it:
wrong values give meaningless ids (each still inside its head's rows) but never a read or write
out of bounds.

Kernels are compiled by Numba and launched by CuPy (``cuda_launch``): a few microseconds of host
time per call. The first call per layer and device uploads the layer's constants and compiles the
kernel; make it before a graph capture.
"""

from __future__ import annotations

from functools import cache

import numpy as np
from numba import cuda, int64

from ..hashing.arithmetic import clamp, roll_context_row, stage_token_ids
from ..hashing.layout import LayerLayout
from ..runtime.backends import cupy_module
from ..runtime.cuda_launch import NumbaKernel

# Tokens per block (fewer for many heads): each thread hashes one token into shared memory, then
# the block writes its ids as one contiguous run, so every warp store is coalesced. (Each thread
# storing its own ``num_heads`` ids directly would hit 32 rows ``8 * num_heads`` bytes apart.)
BLOCKS = (128, 64, 32)
SHARED_BYTES = 48 * 1024  # static shared memory a block may use on every CUDA GPU
# Requests per block in the context-rolling kernel (one thread per request).
ADVANCE_BLOCK = 128


def layout_params(layout: LayerLayout) -> np.ndarray:
    """``int64 [4, max(n, H)]``: multipliers, head sizes, reciprocals (uint64 bits), offsets."""
    heads = layout.num_heads
    params = np.zeros((4, max(layout.ngram_size, heads)), dtype=np.int64)
    params[0, : layout.ngram_size] = layout.multipliers
    params[1, :heads] = layout.head_sizes
    params[2, :heads] = layout.head_magics.view(np.int64)
    params[3, :heads] = layout.head_offsets
    return params


def staging_shape(num_heads: int, block: int | None = None) -> tuple[int, int]:
    """Shared ``[block, row]`` int64 staging for one block's ids: the largest block that fits,
    unless given. ``row`` is odd, so the 8-byte stores of a half-warp land in distinct banks."""
    row = num_heads | 1
    for tokens in (block,) if block else BLOCKS:
        if tokens * row * 8 <= SHARED_BYTES:
            return tokens, row
    raise ValueError(
        f"{num_heads} heads per token do not fit the GPU kernel's {SHARED_BYTES} bytes of shared "
        f"memory (at most {SHARED_BYTES // (8 * BLOCKS[-1]) - 1} heads)"
    )


@cache
def ids_kernel(ngram_size: int, heads_per_ngram: int, block: int | None = None):
    """``(kernel, tokens per block)`` for one ``(ngram_size, heads_per_ngram)`` (and block).

    All are constants of the closure, so the order and head loops unroll and the staging index
    arithmetic divides by a constant.
    """
    heads = (ngram_size - 1) * heads_per_ngram
    shape = staging_shape(heads, block)
    block = shape[0]

    def ngram_ids_kernel(tokens, query_start_loc, context, params, eos, out):
        staged = cuda.shared.array(shape, int64)
        lane = cuda.threadIdx.x
        first = cuda.blockIdx.x * block
        num_tokens = tokens.shape[0]
        stage_token_ids(tokens, query_start_loc, context, params, eos, ngram_size,
                        heads_per_ngram, first + lane, staged, lane)
        cuda.syncthreads()
        count = clamp(num_tokens - first, 0, block) * heads
        for flat in range(lane, count, block):
            row = flat // heads
            head = flat - row * heads
            out[first + row, head] = staged[row, head]

    return NumbaKernel(ngram_ids_kernel), block


def _advance_context_kernel(tokens, query_start_loc, context, out):
    """One thread per request rolls its row as the CPU does, so ``out`` may alias ``context``."""
    r = cuda.grid(1)
    if r < out.shape[0]:
        end = clamp(int64(query_start_loc[r + 1]), int64(0), int64(tokens.shape[0]))
        start = clamp(int64(query_start_loc[r]), int64(0), end)
        roll_context_row(tokens, context, r, start, end, out)


advance_context_kernel = NumbaKernel(_advance_context_kernel)


def launch_ngram_ids(layout: LayerLayout, tokens, query_start_loc, context, params, out,
                     stream=None, block: int | None = None):
    """Launch the ids kernel on device arrays (simulator arrays in tests)."""
    num_tokens = tokens.shape[0]
    if num_tokens:
        kernel, block = ids_kernel(layout.ngram_size, layout.heads_per_ngram, block)
        kernel(-(-num_tokens // block), block,
               (tokens, query_start_loc, context, params, np.int64(layout.eos_token_id), out),
               stream)
    return out


def launch_advance_context(tokens, query_start_loc, context, out, stream=None):
    """Launch the context-rolling kernel on device arrays (simulator arrays in tests)."""
    num_requests = out.shape[0]
    if num_requests:
        advance_context_kernel(-(-num_requests // ADVANCE_BLOCK), ADVANCE_BLOCK,
                               (tokens, query_start_loc, context, out), stream)
    return out


@cache
def device_params(layout: LayerLayout, device: int):
    """The layer's constants on ``device``, uploaded once per device (the only host
    synchronisation)."""
    cupy = cupy_module()
    with cupy.cuda.Device(device):
        array = cupy.asarray(layout_params(layout))
        cupy.cuda.get_current_stream().synchronize()  # once: then any stream may read it
    return array


def ngram_ids_cuda(layout: LayerLayout, tokens, query_start_loc, context, out, stream):
    """Write ids of checked, contiguous CuPy arrays into ``out`` on the CuPy ``stream``."""
    return launch_ngram_ids(layout, tokens, query_start_loc, context,
                            device_params(layout, out.device.id), out, stream)


def advance_context_cuda(tokens, query_start_loc, context, out, stream):
    """Roll contexts of checked, contiguous CuPy arrays into ``out`` on the CuPy ``stream``."""
    return launch_advance_context(tokens, query_start_loc, context, out, stream)
