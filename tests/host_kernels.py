"""``kernels/gather.cu`` built for the host and launched from ``gather_cupy``'s own launch plans.

g++ compiles the kernel source (exactly the text NVRTC gets) with ``tests/host/cuda_host.h``, which
defines CUDA's keywords and walks the launch grid one thread at a time. A launch passes every
parameter through a pointer array, as ``cuLaunchKernel`` does, so the plan's argument packing
(order, sizes, scalar types) is what the host build reads. Built once per source text, cached in
the temporary folder; a misaligned load or store ends the launch and raises.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from ngram_cupy.tables import gather_cupy

try:
    import fcntl
except ImportError:  # not POSIX: concurrent sessions may build the same library twice
    fcntl = None
from ngram_cupy.tables.gather_cupy import Launch

SHIM_DIR = Path(__file__).resolve().with_name("host")
# Compile with the alignment sanitizer, link without its runtime: cuda_host.h handles its reports.
FLAGS = ("-std=c++17", "-O1", "-fPIC", "-ffp-contract=off", "-fsanitize=alignment", "-w")


class MisalignedHostAccess(AssertionError):
    """A kernel loaded or stored a value at an address not aligned to its size (a GPU fault)."""


def compiler() -> str | None:
    """The host C++ compiler (g++), or None."""
    return shutil.which("g++")


def entry_source(names: list[str]) -> str:
    """gather.cu plus one C entry point that launches an instance by its name."""
    dispatch = "\n".join(
        f'    if (std::strcmp(name, "{name}") == 0) return host::launch(&{name}, grid, block, '
        "first, last, params, sizes, count);"
        for name in names
    )
    return f"""#include <cstring>
#include "cuda_host.h"
{gather_cupy.kernel_source("gather.cu")}
extern "C" int host_launch(const char* name, unsigned grid, unsigned block, unsigned first,
                           unsigned last, void** params, const int* sizes, int count) {{
{dispatch}
    return -1;
}}
"""


def build_library(folder: Path | None = None) -> Path:
    """The shared library of every gather instance, built unless a build of this text exists."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no g++ on PATH")
    source = entry_source(gather_cupy.all_instances())
    shim = (SHIM_DIR / "cuda_host.h").read_text()
    key = hashlib.sha256("\0".join([source, shim, cxx, *FLAGS]).encode()).hexdigest()[:16]
    folder = Path(folder or tempfile.gettempdir())
    library = folder / f"ngram_cupy-host-gather-{key}.so"
    with build_lock(folder):  # pytest-xdist workers: one builds, the others wait and load it
        if not library.exists():
            compile_library(cxx, source, folder, library)
    return library


@contextlib.contextmanager
def build_lock(folder: Path):
    """An exclusive lock on ``folder`` (where ``fcntl`` exists) while a build is made or found."""
    if fcntl is None:
        yield
        return
    handle = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        os.close(handle)  # releases the lock


def compile_library(cxx: str, source: str, folder: Path, library: Path) -> None:
    """g++ builds ``source`` into ``library``, atomically."""
    with tempfile.TemporaryDirectory(dir=folder, prefix=".ngram_cupy-host-") as work:
        cpp = Path(work) / "gather_host.cpp"
        cpp.write_text(source)
        built = Path(work) / "gather_host.so"
        for command in ([cxx, *FLAGS, f"-I{SHIM_DIR}", "-c", str(cpp), "-o", f"{built}.o"],
                        [cxx, "-shared", f"{built}.o", "-o", str(built)]):
            run = subprocess.run(command, capture_output=True, text=True)
            if run.returncode:
                raise RuntimeError(f"g++ could not build gather.cu for the host:\n{run.stderr}")
        os.replace(built, library)  # atomic: a concurrent session sees all of it or none


def pack(args: tuple) -> tuple[ctypes.Array, ctypes.Array, list]:
    """``(params, sizes, keep)``: a pointer to each argument's bytes, as CuPy packs them (an array
    passes its data pointer; a NumPy scalar its own bytes), and the buffers to keep alive."""
    keep = []
    for value in args:
        if isinstance(value, np.ndarray):
            keep.append(np.array([value.ctypes.data], dtype=np.uint64))
        elif isinstance(value, np.generic):
            keep.append(np.array([value]))
        else:
            raise TypeError(f"kernel arguments must be arrays or NumPy scalars, got {value!r}")
    params = (ctypes.c_void_p * len(keep))(*[buffer.ctypes.data for buffer in keep])
    sizes = (ctypes.c_int * len(keep))(*[buffer.itemsize for buffer in keep])
    return params, sizes, keep


class HostGather:
    """Runs ``gather_cupy`` launch plans on the host build."""

    def __init__(self, library: Path) -> None:
        lib = ctypes.CDLL(str(library))
        self._launch = lib.host_launch
        self._launch.argtypes = [ctypes.c_char_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
                                 ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
        self._misaligned = lib.host_misaligned
        self._misaligned.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self._misaligned.restype = ctypes.c_longlong

    def run(self, plan: Launch, blocks: range | None = None) -> None:
        """Run ``plan`` (every block, or only ``blocks``); raise on any misaligned access."""
        blocks = blocks if blocks is not None else range(plan.grid)
        params, sizes, _keep = pack(plan.args)
        status = self._launch(plan.name.encode(), plan.grid, plan.block, blocks.start, blocks.stop,
                              params, sizes, len(plan.args))
        if status == -1:
            raise LookupError(f"no host build of {plan.name}")
        if status == -2:
            raise TypeError(f"{plan.name}: {len(plan.args)} arguments packed, the kernel differs")
        if status > 0:
            raise TypeError(f"{plan.name}: argument {status - 1} packed as {sizes[status - 1]} "
                            "bytes, the kernel's parameter differs")
        address, alignment = ctypes.c_uint64(), ctypes.c_uint()
        if self._misaligned(ctypes.byref(address), ctypes.byref(alignment)) or status == -3:
            raise MisalignedHostAccess(f"{plan.name}: a misaligned access at {address.value:#x} "
                                   f"(needs {alignment.value}-byte alignment) ended the launch")

    def gather(self, table, code, row_start, scale, ids, out, out_code, expected=None):
        """``gather_cupy.gather_rows`` on NumPy arrays: the same plan, run on the host."""
        plan = gather_cupy.launch_plan(table, code, row_start, scale, ids, out, out_code, expected)
        if plan is not None:
            self.run(plan)
        return out


def reserve(shape: tuple[int, ...], dtype) -> np.ndarray:
    """A huge zeroed array whose pages exist only once touched (Linux ``MAP_NORESERVE``)."""
    if not sys.platform.startswith("linux"):
        raise OSError("needs Linux MAP_NORESERVE")
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0x4000)
    memory = mmap.mmap(-1, size, flags=flags)
    return np.frombuffer(memory, dtype=dtype).reshape(shape)
