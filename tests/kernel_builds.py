"""Numba CUDA kernels compiled on the CPU, once per session: PTX and LLVM IR from one lowering.

The PTX feeds the instruction and parameter-size checks, the IR the parameter-name check (Numba's
IR names each kernel parameter after its Python argument and ABI field; PTX numbers them).
A session's processes (pytest-xdist workers) share the builds through a folder conftest.py makes:
the first to need a kernel lowers it under a lock, the others read it (a lowering costs seconds).
"""

from __future__ import annotations

import hashlib
import os
import pickle
import types as pytypes
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from unittest import mock

try:
    import fcntl
except ImportError:  # not POSIX: each process lowers its own kernels
    fcntl = None

from numba import cuda, types
from numba.cuda.compiler import compile_cuda, kernel_fixup

from ngram_cupy.runtime.cuda_launch import NumbaKernel, numba_type

# Numba asks the driver for a compute capability when a kernel calls a helper: answer for it.
_DEVICE = pytypes.SimpleNamespace(compute_capability=(9, 0))
# The session's shared build folder (set by conftest.py) and the capabilities the tests check.
SHARED_ENV = "NGRAM_CUPY_TEST_BUILDS"
SHARED_CCS = ((8, 0), (9, 0))


@dataclass(frozen=True)
class Build:
    """One kernel compiled for one signature and compute capability."""

    ptx: str
    llvm_ir: str
    function: str  # the kernel's name in both


@cache
def lower(py_func, signature: tuple):
    """``py_func`` lowered to NVVM IR as a kernel, as ``cuda.compile_ptx`` does (optimised, no
    fast math): (code library, kernel name). The IR does not depend on the compute capability
    (only NVVM does), so every capability's PTX comes from this one lowering, as in Numba's own
    dispatcher; lowering costs seconds, NVVM a tenth of that."""
    with mock.patch.object(cuda.dispatcher, "get_current_device", lambda: _DEVICE):
        result = compile_cuda(py_func, types.void, signature, cc=_DEVICE.compute_capability,
                              nvvm_options={"fastmath": False, "opt": 3})
        library = result.library
        function = result.fndesc.llvm_func_name
        kernel_fixup(library.get_function(function), False)
        return library, function


def build_here(py_func, signature: tuple, cc: tuple[int, int]) -> Build:
    """``py_func`` compiled as a kernel for ``signature`` and ``cc`` in this process."""
    library, function = lower(py_func, signature)
    return Build(library.get_asm_str(cc=cc), library.get_llvm_str(), function)


@cache
def build(py_func, signature: tuple, cc: tuple[int, int]) -> Build:
    """``py_func`` compiled as a kernel for ``signature`` and compute capability ``cc``, by this
    process or another of the session (with the PTX of every capability in ``SHARED_CCS``)."""
    folder = os.environ.get(SHARED_ENV)
    if folder is None or fcntl is None:
        return build_here(py_func, signature, cc)
    closure = tuple(cell.cell_contents for cell in py_func.__closure__ or ())
    name = repr((py_func.__module__, py_func.__qualname__, closure, tuple(map(str, signature))))
    entry = Path(folder) / hashlib.sha256(name.encode()).hexdigest()[:32]
    with open(entry.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        builds = pickle.loads(entry.read_bytes()) if entry.exists() else {}
        if cc not in builds:
            builds.update({c: build_here(py_func, signature, c) for c in {cc, *SHARED_CCS}})
            partial = entry.with_suffix(".partial")
            partial.write_bytes(pickle.dumps(builds))
            os.replace(partial, entry)
        return builds[cc]


def build_for(kernel: NumbaKernel, args: tuple, cc: tuple[int, int] = (9, 0)) -> Build:
    """The build of ``kernel`` for the types of ``args`` (arrays and NumPy scalars)."""
    return build(kernel.py_func, tuple(numba_type(a) for a in args), cc)
