"""float32 operations rounded one at a time on every target, for arithmetic shared by the CPU
and CUDA update kernels.

NVVM contracts a multiply feeding an add into one fused multiply-add by default (one rounding
instead of two), so ``w - lr * g`` compiled for a GPU would give other bits than on the CPU,
where LLVM contracts nothing without fast math. Here the CUDA target calls libdevice's
round-to-nearest operations, which are never fused; the CPU target and plain Python (the CUDA
simulator, NumPy float32 scalars) use the operators themselves. Square root and division are
correctly rounded everywhere.
"""

from __future__ import annotations

import numpy as np
from numba.core.extending import overload

try:  # numba-cuda: without it no CUDA kernel compiles, and only the CPU forms are needed
    from numba.cuda import libdevice
    from numba.cuda.extending import overload as cuda_overload
except Exception:
    libdevice = cuda_overload = None


def mul(a, b):
    """``a * b`` rounded to float32."""
    return a * b


def add(a, b):
    """``a + b`` rounded to float32."""
    return a + b


def sub(a, b):
    """``a - b`` rounded to float32."""
    return a - b


def div(a, b):
    """``a / b`` rounded to float32."""
    return a / b


def sqrt(a):
    """The correctly rounded float32 square root of ``a``."""
    return np.sqrt(a)


@overload(mul, target="cpu")
def _mul_cpu(a, b):
    return lambda a, b: a * b


@overload(add, target="cpu")
def _add_cpu(a, b):
    return lambda a, b: a + b


@overload(sub, target="cpu")
def _sub_cpu(a, b):
    return lambda a, b: a - b


@overload(div, target="cpu")
def _div_cpu(a, b):
    return lambda a, b: a / b


@overload(sqrt, target="cpu")
def _sqrt_cpu(a):
    return lambda a: np.sqrt(a)


if cuda_overload is not None:

    @cuda_overload(mul)
    def _mul_cuda(a, b):
        return lambda a, b: libdevice.fmul_rn(a, b)

    @cuda_overload(add)
    def _add_cuda(a, b):
        return lambda a, b: libdevice.fadd_rn(a, b)

    @cuda_overload(sub)
    def _sub_cuda(a, b):
        return lambda a, b: libdevice.fsub_rn(a, b)

    @cuda_overload(div)
    def _div_cuda(a, b):
        return lambda a, b: libdevice.fdiv_rn(a, b)

    @cuda_overload(sqrt)
    def _sqrt_cuda(a):
        return lambda a: libdevice.fsqrt_rn(a)
