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

import operator

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


def implemented_by(operation, arity: int = 2):
    """An overload whose compiled form is ``operation`` of the arguments."""
    if arity == 1:
        return lambda a: lambda a: operation(a)
    return lambda a, b: lambda a, b: operation(a, b)


for _function, _cpu in ((mul, operator.mul), (add, operator.add), (sub, operator.sub),
                        (div, operator.truediv)):
    overload(_function, target="cpu")(implemented_by(_cpu))
overload(sqrt, target="cpu")(implemented_by(np.sqrt, 1))

if cuda_overload is not None:
    for _function, _gpu in ((mul, libdevice.fmul_rn), (add, libdevice.fadd_rn),
                            (sub, libdevice.fsub_rn), (div, libdevice.fdiv_rn)):
        cuda_overload(_function)(implemented_by(_gpu))
    cuda_overload(sqrt)(implemented_by(libdevice.fsqrt_rn, 1))
