"""Launch Numba-compiled CUDA kernels through CuPy: Numba's shared arithmetic, CuPy's cheap launch.

Numba's own launcher re-types and converts every array argument on each call (tens of
microseconds for a handful of arrays, too slow for a decode step), and blocks on the stream a CUDA
array interface names. Here each kernel is compiled once per device architecture and argument
types to PTX by Numba, assembled to a cubin by nvJitLink where cuda-python provides it (the driver
cannot load PTX from an NVVM newer than itself), loaded as a CuPy module, and launched by CuPy on
the caller's stream with arrays passed in Numba's kernel ABI: for every array its meminfo and
parent pointers (unused on the device, zero), size, itemsize, data pointer, then its shape and
strides.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import re
import threading
import types as pytypes
from collections.abc import Callable, Iterator
from itertools import zip_longest
from typing import Any

import numpy as np
from numba import config, cuda, from_dtype, types

from . import kernel_cache
from .backends import cupy_module
from .kernel_cache import entry_key, function_digest, numba_versions

# numba-cuda 0.30 registers an overload of ``np.row_stack``, which NumPy 2.5 removed (it was an
# alias of ``vstack``): its first compile then fails on every kernel. The alias restores it.
if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack

_ENTRY = re.compile(r"\.entry\s+([\w$.]+)\s*\(")
# Launches noted instead of run (``recorded_launches``): how ``ngram-cupy compile`` learns the
# kernels and argument types the library's launchers use, from the launchers themselves.
_RECORDED: contextvars.ContextVar[list | None] = contextvars.ContextVar("recorded", default=None)


@contextlib.contextmanager
def recorded_launches() -> Iterator[list[tuple[NumbaKernel, tuple]]]:
    """Inside the block, ``NumbaKernel`` launches (on any arrays, NumPy ones included) run
    nothing and are listed as ``(kernel, args)``."""
    launches: list[tuple[NumbaKernel, tuple]] = []
    token = _RECORDED.set(launches)
    try:
        yield launches
    finally:
        _RECORDED.reset(token)


def entry_name(ptx: str) -> str:
    """The single kernel entry point of a Numba-compiled PTX module."""
    names = _ENTRY.findall(ptx)
    if len(names) != 1:
        raise RuntimeError(f"expected one kernel entry in the PTX, found {len(names)}")
    return names[0]


def entry_params(ptx: str) -> list[str]:
    """The PTX parameter types (``u64``, ``f32``, ...) of the kernel entry, in order."""
    start = _ENTRY.search(ptx).end()
    body = ptx[start : ptx.index(")", start)]
    return re.findall(r"\.param\s+\.(\w+)", body)


def param_bytes(value: Any) -> int:
    """Bytes one flattened argument occupies as a kernel parameter (a device array: a pointer)."""
    return 8 if hasattr(value, "ndim") and value.ndim > 0 else np.dtype(value.dtype).itemsize


def check_abi(ptx: str, args: tuple, name: str) -> None:
    """The flattened arguments must match the kernel's PTX parameters one for one, in size."""
    declared = [int(re.sub(r"\D", "", kind)) // 8 for kind in entry_params(ptx)]
    passed = [param_bytes(x) for a in args for x in flatten(a)]
    if declared != passed:
        raise RuntimeError(
            f"{name}: the compiled kernel's parameters (bytes {declared}) do not match the "
            f"launcher's (bytes {passed}); this Numba version changed its kernel ABI"
        )


def numba_type(value: Any):
    """The Numba type a kernel argument compiles for: C-contiguous arrays and typed scalars."""
    if hasattr(value, "dtype") and getattr(value, "ndim", 0) > 0:
        return types.Array(from_dtype(value.dtype), value.ndim, "C")
    if isinstance(value, np.generic):
        return from_dtype(value.dtype)
    raise TypeError(f"kernel arguments must be arrays or NumPy scalars, got {type(value).__name__}")


def flatten_named(value: Any, name: str) -> tuple[tuple[str, Any], ...]:
    """One argument as Numba's kernel ABI spells it, each field beside the name Numba's LLVM IR
    gives that parameter (``name.0`` meminfo, ``.1`` parent, ``.2`` size, ``.3`` itemsize, ``.4``
    data, ``.5.i`` shape, ``.6.i`` strides; a scalar is ``name``), so the order can be checked."""
    if hasattr(value, "dtype") and getattr(value, "ndim", 0) > 0:
        return ((f"{name}.0", np.uint64(0)), (f"{name}.1", np.uint64(0)),
                (f"{name}.2", np.int64(value.size)), (f"{name}.3", np.int64(value.itemsize)),
                (f"{name}.4", value),
                *((f"{name}.5.{i}", np.int64(n)) for i, n in enumerate(value.shape)),
                *((f"{name}.6.{i}", np.int64(n)) for i, n in enumerate(value.strides)))
    return ((name, value),)


def flatten(value: Any) -> tuple:
    """One argument's kernel parameters, in Numba's ABI order (``flatten_named`` without names)."""
    return tuple(field for _, field in flatten_named(value, ""))


def llvm_params(llvm_ir: str, function: str) -> list[str]:
    """The parameter names of ``function`` in Numba's LLVM IR (its return slot left out)."""
    start = llvm_ir.index(f'@"{function}"(') if f'@"{function}"(' in llvm_ir else llvm_ir.index(
        f"@{function}(")
    header = llvm_ir[start : llvm_ir.index(")", llvm_ir.index("(", start) + 1)]
    names = re.findall(r'%"?([^",\s)]+)"?\s*(?:,|$)', header + ",")
    return [name for name in names if name != ".ret"]


def check_abi_names(llvm_ir: str, function: str, py_func: Callable, args: tuple) -> None:
    """Each packed field must be the parameter Numba's IR reads it as, in order (not just size:
    every array field is 8 bytes, so a swap of two would pass a size check)."""
    names = list(inspect.signature(py_func).parameters)
    if len(names) != len(args):
        raise RuntimeError(f"{py_func.__name__} takes {len(names)} arguments, {len(args)} passed")
    passed = [label for name, a in zip(names, args, strict=True)
              for label, _ in flatten_named(a, name)]
    declared = llvm_params(llvm_ir, function)
    for index, (compiled, packed) in enumerate(zip_longest(declared, passed)):
        if compiled != packed:
            raise RuntimeError(
                f"{py_func.__name__}: parameter {index} of the compiled kernel is {compiled!r}, "
                f"the launcher packs {packed!r} there; this Numba version changed its kernel ABI"
            )


def assemble(ptx: str, cc: tuple[int, int]) -> bytes:
    """A loadable image of ``ptx``: a cubin for ``cc`` linked by nvJitLink (cuda-python, which
    numba-cuda depends on), else the PTX itself (NUL-terminated) for the driver to compile."""
    try:
        from cuda.bindings import nvjitlink

        handle = nvjitlink.create(1, [f"-arch=sm_{cc[0]}{cc[1]}"])
    except Exception:  # no cuda-python, or no libnvJitLink to load
        return ptx.encode() + b"\0"
    try:
        data = ptx.encode()
        nvjitlink.add_data(handle, nvjitlink.InputType.PTX, data, len(data), "numba.ptx")
        nvjitlink.complete(handle)
        cubin = bytearray(nvjitlink.get_linked_cubin_size(handle))
        nvjitlink.get_linked_cubin(handle, cubin)
        return bytes(cubin)
    except Exception:  # refused (an nvJitLink older than the NVVM?): the driver may take the PTX
        return ptx.encode() + b"\0"
    finally:
        nvjitlink.destroy(handle)


_TARGET_LOCK = threading.Lock()


@contextlib.contextmanager
def target_capability(cc: tuple[int, int]) -> Iterator[None]:
    """Numba compiles the device functions a kernel calls for the current device's compute
    capability, which needs a driver and a device: answer ``cc`` instead, so that kernels build
    for any architecture on any machine (one compile at a time)."""
    dispatcher = cuda.dispatcher
    with _TARGET_LOCK:
        current = dispatcher.get_current_device
        dispatcher.get_current_device = lambda: pytypes.SimpleNamespace(compute_capability=cc)
        try:
            yield
        finally:
            dispatcher.get_current_device = current


def _signature_key(args: tuple) -> tuple:
    """A cheap hashable key of the argument types (dtype and ndim of arrays, scalar dtypes)."""
    return tuple((a.dtype.char, a.ndim) if hasattr(a, "ndim") else type(a) for a in args)


def array_device(args: tuple, cupy):
    """The CuPy device of the first device array among ``args`` (else the current device)."""
    for value in args:
        device = getattr(value, "device", None)
        if device is not None and hasattr(device, "id"):
            return cupy.cuda.Device(device.id)
    return cupy.cuda.Device()


class NumbaKernel:
    """A ``cuda.jit``-style Python kernel launched through CuPy, compiled per device and types."""

    def __init__(self, py_func: Callable) -> None:
        self.py_func = py_func
        self.name = py_func.__name__
        self._functions: dict[tuple, Any] = {}
        self._simulated = None

    def ptx(self, args: tuple, cc: tuple[int, int]) -> str:
        """PTX of the kernel for the types of ``args`` on compute capability ``cc``."""
        return self.compiled(tuple(numba_type(a) for a in args), cc)["ptx"]

    def compiled(self, signature: tuple, cc: tuple[int, int]) -> dict[str, str | bytes]:
        """``{"ptx", "image"}`` of the kernel for Numba argument types ``signature`` on ``cc``:
        from the kernel cache (``kernel_cache``), else compiled by Numba and nvJitLink, which
        need no GPU, and kept there."""
        key = entry_key("numba", function_digest(self.py_func), tuple(map(str, signature)),
                        tuple(cc), numba_versions())

        def build() -> dict[str, str | bytes]:
            with target_capability(tuple(cc)):
                ptx = cuda.compile_ptx(self.py_func, signature, cc=cc)[0]
            return {"ptx": ptx, "image": assemble(ptx, cc)}

        return kernel_cache.KERNELS.fetch(
            key, build, lambda fields: isinstance(fields.get("ptx"), str)
            and isinstance(fields.get("image"), bytes))

    def _load(self, args: tuple, device) -> Any:
        """Load the kernel (compiled or from the kernel cache) on ``device``; its parameters
        checked against the launcher's once."""
        cupy = cupy_module()
        capability = device.compute_capability  # e.g. "90"
        cc = (int(capability[:-1]), int(capability[-1]))
        fields = self.compiled(tuple(numba_type(a) for a in args), cc)
        ptx = fields["ptx"]
        check_abi(ptx, args, self.name)
        module = cupy.cuda.function.Module()
        with device:
            try:
                module.load(fields["image"])
            except cupy.cuda.driver.CUDADriverError as error:
                raise RuntimeError(
                    f"{self.name}: the CUDA driver could not load Numba's code ({error}); PTX "
                    "from an NVVM newer than the driver needs nvJitLink (pip install "
                    "'numba-cuda[cu13]' brings it), or an NVVM no newer than the driver"
                ) from error
            return module.get_function(entry_name(ptx))

    def __call__(self, grid: int, block: int, args: tuple, stream=None) -> None:
        """Launch on ``stream`` (a CuPy stream; default: the current one) of the arrays' device.

        Under the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``) the same Python kernel runs on
        simulator arrays instead, which is how CI executes it.
        """
        recorded = _RECORDED.get()
        if recorded is not None:
            recorded.append((self, args))
            return
        if config.ENABLE_CUDASIM:
            if self._simulated is None:
                self._simulated = cuda.jit(self.py_func)
            self._simulated[grid, block](*args)
            return
        cupy = cupy_module()
        device = array_device(args, cupy)
        key = (device.id, _signature_key(args))
        function = self._functions.get(key)
        if function is None:
            function = self._functions[key] = self._load(args, device)
        flat = tuple(x for a in args for x in flatten(a))
        with device:  # the module's context is the arrays' device's, whichever is current
            function((grid,), (block,), flat, stream=stream)
