"""One decorator for the helpers that CPU (``numba.njit``) and CUDA kernels both inline.

``numba.core.extending.register_jitable(inline="always")`` serves both targets with Numba's
built-in CUDA target, but NVIDIA's ``numba-cuda`` package (which replaces ``numba.cuda``) runs its
own inliner on CUDA kernels and fails on numba-core overloads marked ``inline="always"`` (an
``AssertionError`` in its post-processing, numba-cuda 0.30). With ``numba-cuda`` the CPU target
therefore gets a numba-core overload, inlined in Numba's IR (without that the CPU ids kernel ran
2.5x slower), and the CUDA target numba-cuda's own ``register_jitable`` with ``forceinline``, so
that NVVM inlines the helper: the same PTX, but IR-level inlining retypes each helper at every
call site, which took 13 s to lower the fused NVFP4 kernel against 1 s. The CPU overload declines
under the CUDA target: numba-cuda's inliner looks through every overload of a function, and once
a CPU kernel had inlined a helper for the same argument types it took the CPU overload's record
and failed to type the CUDA kernel.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable
from types import ModuleType

import numpy as np
from numba.core.extending import overload, register_jitable
from numba.core.target_extension import current_target


def _numba_cuda_register_jitable() -> Callable | None:
    """numba-cuda's ``register_jitable``; None with Numba's built-in CUDA target (which has
    none) or when ``numba.cuda`` cannot be imported (numba-cuda without its CUDA bindings)."""
    try:
        from numba.cuda import extending
    except Exception:
        return None
    return getattr(extending, "register_jitable", None)


def inline_jitable(fn: Callable) -> Callable:
    """Make ``fn`` callable from CPU and CUDA kernels, inlined into them (see above; plain
    Python, as under the CUDA simulator, stays plain Python)."""
    cuda_register = _numba_cuda_register_jitable()
    if cuda_register is None:
        return register_jitable(inline="always")(fn)
    overload(fn, target="cpu", inline="always", strict=False)(
        lambda *args, **kwargs: fn if current_target() == "cpu" else None)
    cuda_register(forceinline=True)(fn)
    return fn


def source_digest(*modules: ModuleType) -> int:
    """A 56-bit digest of the modules' source. Numba's on-disk cache watches only the file of
    the kernel it compiles; a kernel that inlines code from other modules carries this digest
    in its closure (its cache key), so editing them never reuses stale machine code."""
    digest = hashlib.sha256()
    for module in modules:
        digest.update(inspect.getsource(module).encode())
    return int.from_bytes(digest.digest()[:7], "little")


def read_only(array: np.ndarray | None) -> np.ndarray | None:
    """A read-only view of ``array`` for a kernel that only reads it: Numba types writable and
    read-only arrays apart, so one type for both (read-only: mapped, shared, Arrow buffers)
    halves the kernels it compiles."""
    if array is None or not array.flags.writeable:
        return array
    view = array.view()
    view.flags.writeable = False
    return view
