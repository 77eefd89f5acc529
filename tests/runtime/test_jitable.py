"""inline_jitable: one helper, inlined into CPU kernels and CUDA kernels alike, whichever target
compiles it first; the CUDA kernel's PTX calls no helper."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_builds import lower
from numba import njit, types

from ngram_cupy.runtime.jitable import inline_jitable

SIGNATURE = (types.Array(types.int64, 1, "C"), types.int64, types.Array(types.int64, 1, "C"))


def fresh_kernel():
    """A kernel over two fresh helpers (one calling the other): no target compiled them yet."""

    @inline_jitable
    def below(value, limit):
        return value < limit

    @inline_jitable
    def count_below(values, limit):
        count = 0
        for v in values:
            count += below(v, limit)
        return count

    def kernel(values, limit, out):
        out[0] = count_below(values, limit)

    return kernel


@pytest.mark.parametrize("first", ["cpu", "cuda"])
def test_a_helper_serves_both_targets_in_either_order(first):
    """A CPU kernel that inlined the helpers for the very argument types the CUDA kernel passes
    (its record is there to be found) leaves the CUDA kernel's typing alone, and back."""
    kernel = fresh_kernel()
    for target in (first, "cuda" if first == "cpu" else "cpu"):
        if target == "cpu":
            out = np.zeros(1, np.int64)
            njit(kernel)(np.array([3, 9, -2, 7], np.int64), np.int64(5), out)
            assert out[0] == 2
        else:
            library, function = lower(kernel, SIGNATURE)
            ptx = library.get_asm_str(cc=(9, 0))
            body = ptx[ptx.index(f".entry {function}"):]
            assert "call" not in body  # the helpers are inlined (NVVM)
