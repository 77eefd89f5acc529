"""Per-token hash arithmetic shared by every compiled path: Numba CPU, Numba CUDA, the simulator.

It also holds the device helpers the ids and fused kernels share (request search, clamping,
staging a token's ids, rolling a context row), so no kernel module imports another's internals.

Each function here is ``inline_jitable``: plain Python when called from Python (the CUDA
simulator runs exactly these bodies), compiled by Numba when called from an ``@njit`` function or a
``@cuda.jit`` kernel. All wrapping arithmetic is done in uint64, where it is the same bit pattern
as the reference's wrapping int64.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import int64, types, uint64
from numba.core.extending import intrinsic, overload

from ..runtime.jitable import inline_jitable


def umulhi(a, b):
    """High 64 bits of the 128-bit product of two uint64 values."""
    return np.uint64((int(a) * int(b)) >> 64)


@intrinsic
def _umulhi_llvm(typingctx, a, b):
    """``umulhi`` as one widening multiply: ``mul`` + ``umulh`` on CPUs, ``mul.hi.u64`` in PTX."""
    sig = types.uint64(types.uint64, types.uint64)

    def codegen(context, builder, signature, args):
        wide = ir.IntType(128)
        product = builder.mul(builder.zext(args[0], wide), builder.zext(args[1], wide))
        return builder.trunc(builder.lshr(product, ir.Constant(wide, 64)), ir.IntType(64))

    return sig, codegen


@overload(umulhi)
def _umulhi_compiled(a, b):
    """Compiled targets use the widening multiply instead of Python ints."""
    return lambda a, b: _umulhi_llvm(uint64(a), uint64(b))


@inline_jitable
def floor_mod(x, size, magic):
    """``x mod size`` as Python's ``%`` (non-negative) for int64 ``x`` without a division.

    ``magic`` is ``floor(2**64 / size)`` for ``2 <= size < 2**63``; the estimated quotient is at
    most one short, so one conditional subtraction finishes it. Negative ``x`` uses
    ``x mod s = s - 1 - (~x mod s)`` so the reduced value is always below ``2**63``.
    """
    negative = x < 0
    y = uint64(~x) if negative else uint64(x)
    r = y - umulhi(y, magic) * size
    if r >= size:
        r -= size
    if negative:
        r = size - uint64(1) - r
    return int64(r)


@inline_jitable
def write_token_ids(tokens, context, request, start, t, ngram_size, heads_per_ngram, eos,
                    multipliers, sizes, magics, offsets, out, row):
    """Write the ``(ngram_size - 1) * heads_per_ngram`` row ids of token ``t`` into ``out[row]``.

    Walks back from ``t`` one token per order, reading the request's context before ``start``;
    once an EOS has been read behind ``t`` every older token reads as EOS. Order ``g`` hashes
    ``XOR_{j<g} w_j * m_j`` (wrapping) into its ``heads_per_ngram`` heads.
    """
    mixed = uint64(int64(tokens[t])) * uint64(multipliers[0])
    blocked = False
    head = 0
    for j in range(1, ngram_size):
        position = t - j
        if position >= start:
            w = int64(tokens[position])
        else:
            w = int64(context[request, ngram_size - 1 - (start - position)])
        if blocked:
            w = eos
        blocked |= w == eos
        mixed ^= uint64(w) * uint64(multipliers[j])
        signed = int64(mixed)
        for _ in range(heads_per_ngram):
            reduced = floor_mod(signed, uint64(sizes[head]), uint64(magics[head]))
            out[row, head] = reduced + offsets[head]
            head += 1


@inline_jitable
def clamp(value, low, high):
    """``value`` limited to ``[low, high]`` (Numba's CUDA target cannot type ``min(max(...))``)."""
    if value < low:
        return low
    if value > high:
        return high
    return value


@inline_jitable
def find_request(query_start_loc, t):
    """The last request ``r < R`` with ``query_start_loc[r] <= t``, by binary search.

    A padded token (``t >= query_start_loc[R]``, docs/ids.md) gets ``R - 1``, as vLLM's kernel
    clamps its search. Reads only ``query_start_loc[1..R-1]``, and returns a valid row whatever
    those hold.
    """
    lo = 0
    hi = query_start_loc.shape[0] - 1
    while hi - lo > 1:
        mid = (lo + hi) >> 1
        if query_start_loc[mid] <= t:
            lo = mid
        else:
            hi = mid
    return lo


@inline_jitable
def stage_token_ids(tokens, query_start_loc, context, params, eos, ngram_size, heads_per_ngram,
                    t, staged, row):
    """Hash token ``t``, if it exists, into ``staged[row]`` (shared memory): a block's threads
    stage one token each, then store or use the ids together (the ids and fused kernels).
    ``params`` is ``[multipliers, sizes, reciprocals, offsets]`` as int64 rows."""
    if t < tokens.shape[0]:
        request = find_request(query_start_loc, t)
        start = clamp(int64(query_start_loc[request]), int64(0), int64(t))
        write_token_ids(tokens, context, request, start, t, ngram_size, heads_per_ngram, eos,
                        params[0], params[1], params[2], params[3], staged, row)


@inline_jitable
def roll_context_row(tokens, context, request, start, end, out):
    """``out[request]``: the last ``out.shape[1]`` of ``context[request] ++ tokens[start:end]``.

    Safe in place (``out`` aliasing ``context``): each entry reads at or after the one it writes.
    Shared by the CPU and GPU kernels.
    """
    width = out.shape[1]
    for i in range(width):
        position = end - width + i
        if position >= start:
            out[request, i] = tokens[position]
        else:
            out[request, i] = context[request, i + (end - start)]
