"""Per-token hash arithmetic shared by every compiled path: Numba CPU, Numba CUDA, the simulator.

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

from .jitable import inline_jitable


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
