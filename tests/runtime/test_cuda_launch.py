"""The CuPy launcher of Numba kernels: what it passes must match Numba's compiled kernel ABI.

A mismatch would pass garbage pointers on the GPU, so every kernel the library ships is compiled
here (no GPU needed, once per session) and its parameters compared with the flattened arguments
the launcher builds for the same call: in count and size against the PTX, and field by field, in
order, against the parameter names of Numba's LLVM IR (sizes alone cannot tell two 8-byte fields
apart).
"""

from __future__ import annotations

import subprocess
import sys
import types as pytypes

import numpy as np
import pytest
from kernel_builds import build_for
from numba import cuda

import ngram_cupy as nc
from ngram_cupy.codecs import dequant
from ngram_cupy.ids import fused_cuda, ids_cuda
from ngram_cupy.runtime import cuda_launch
from ngram_cupy.runtime.cuda_launch import (
    assemble,
    check_abi,
    check_abi_names,
    entry_name,
    entry_params,
    flatten,
    llvm_params,
)


@pytest.fixture(autouse=True)
def no_device(monkeypatch):
    """Numba asks the driver for a compute capability when a kernel calls a helper."""
    device = pytypes.SimpleNamespace(compute_capability=(9, 0))
    monkeypatch.setattr(cuda.dispatcher, "get_current_device", lambda: device)


def _layout(n, k):
    return nc.layer_layout(nc.NGramConfig(1000, n, k, 500, 3, embedding_dim=(n - 1) * k * 4), 0)


# Both index types and three shapes, in the specialisations whose PTX test_ids_cuda checks:
# each kernel build (seconds of lowering) then serves both tests.
@pytest.mark.parametrize("n, k, index", [(3, 8, np.int64), (3, 8, np.int32), (2, 1, np.int64),
                                         (5, 3, np.int32)], ids=str)
def test_ids_kernel_abi(n, k, index):
    layout = _layout(n, k)
    kernel, _ = ids_cuda.ids_kernel(n, k)
    args = (np.zeros(4, index), np.zeros(2, index), np.zeros((1, n - 1), index),
            ids_cuda.layout_params(layout), np.int64(3), np.zeros((4, layout.num_heads), np.int64))
    assert "mul.hi.u64" in check_both(kernel, args).ptx


def check_both(kernel, args, cc=(9, 0)):
    """Both ABI checks of one kernel call; its (session-cached) build."""
    build = build_for(kernel, args, cc)
    check_abi(build.ptx, args, kernel.name)
    check_abi_names(build.llvm_ir, build.function, kernel.py_func, args)
    return build


def test_advance_context_kernel_abi():
    args = (np.zeros(4, np.int32), np.zeros(3, np.int64), np.zeros((3, 2), np.int64),
            np.zeros((2, 2), np.int64))
    check_both(ids_cuda.advance_context_kernel, args, (8, 0))


# Two word widths (8 and 4 bytes) in two of the kernels whose PTX test_gather_kernels checks: the
# builds serve both tests.
@pytest.mark.parametrize("code, out_code, head_dim", [(dequant.FLOAT8_E4M3, dequant.BFLOAT16, 160),
                                                      (dequant.FLOAT32, dequant.FLOAT16, 3)])
def test_fused_kernel_abi(code, out_code, head_dim):
    layout = nc.layer_layout(nc.NGramConfig(1000, 3, 8, 500, 3, embedding_dim=16 * head_dim), 0)
    kernel, _ = fused_cuda.fused_kernel(3, 8, head_dim, code, out_code)
    rows = np.zeros((10, head_dim), dequant.FORMATS[code].raw)
    args = (np.zeros(4, np.int64), np.zeros(2, np.int64), np.zeros((1, 2), np.int64),
            ids_cuda.layout_params(layout), np.int64(3),
            fused_cuda.table_words(rows, dequant.FORMATS[code].itemsize), np.int64(0),
            np.float32(1), np.bool_(True), np.zeros((4, 16), np.int64),
            np.zeros((4, 16 * head_dim), dequant.FORMATS[out_code].raw),
            np.zeros((10, 1), np.uint8),  # block scales: a placeholder for these formats
            np.int64(0),  # the scales' byte column (packed records: past the row's values)
            np.int64(10), np.zeros(1, np.uint64))  # total rows, the first bad position's word
    check_both(kernel, args)


def _ids_args():
    return (np.zeros(4, np.int64), np.zeros(2, np.int64), np.zeros((1, 1), np.int64),
            ids_cuda.layout_params(_layout(2, 1)), np.int64(3), np.zeros((4, 1), np.int64))


def test_abi_check_catches_a_mismatch():
    kernel, _ = ids_cuda.ids_kernel(2, 1)
    args = _ids_args()
    build = check_both(kernel, args)
    with pytest.raises(RuntimeError, match="ABI"):
        check_abi(build.ptx, args[:4] + (np.int32(3),) + args[5:], kernel.name)  # 4-byte scalar
    with pytest.raises(RuntimeError, match="ABI"):
        check_abi(build.ptx, args[:-1], kernel.name)


@pytest.mark.parametrize("swap", [(0, 2), (2, 4), (5, 6)],
                         ids=["meminfo-size", "size-data", "shape-strides"])
def test_abi_name_check_catches_a_swapped_packing(monkeypatch, swap):
    """Two 8-byte fields packed in each other's place pass the size check, not the name check."""
    kernel, _ = ids_cuda.ids_kernel(2, 1)
    args = _ids_args()
    build = build_for(kernel, args)
    packed = cuda_launch.flatten_named

    def swapped(value, name):
        fields = list(packed(value, name))
        if len(fields) > 1:
            first, second = swap
            fields[first], fields[second] = fields[second], fields[first]
        return tuple(fields)

    monkeypatch.setattr(cuda_launch, "flatten_named", swapped)
    check_abi(build.ptx, args, kernel.name)  # sizes cannot tell
    with pytest.raises(RuntimeError, match=rf"parameter {swap[0]} of the compiled kernel is "
                                           rf"'tokens\.{swap[0]}(\.0)?', the launcher packs"):
        check_abi_names(build.llvm_ir, build.function, kernel.py_func, args)


def test_abi_name_check_catches_reordered_and_missing_arguments():
    kernel, _ = ids_cuda.ids_kernel(2, 1)
    args = _ids_args()
    build = build_for(kernel, args)
    with pytest.raises(RuntimeError, match="6 arguments, 5 passed"):
        check_abi_names(build.llvm_ir, build.function, kernel.py_func, args[:-1])

    def reordered(tokens, context, query_start_loc, params, eos, out):  # same types, same sizes
        pass

    with pytest.raises(RuntimeError, match="'query_start_loc.0', the launcher packs 'context.0'"):
        check_abi_names(build.llvm_ir, build.function, reordered, args)
    assert llvm_params(build.llvm_ir, build.function)[-2:] == ["out.6.0", "out.6.1"]


def test_flatten_and_entry_parsing():
    array = np.zeros((3, 5), np.float32)
    flat = flatten(array)
    assert [int(x) for x in flat[:4]] == [0, 0, 15, 4]
    assert flat[4] is array and [int(x) for x in flat[5:]] == [3, 5, 20, 4]
    assert flatten(np.int64(7)) == (np.int64(7),)
    ptx = ".visible .entry _Z1kPx(\n\t.param .u64 a,\n\t.param .f32 b\n)\n{\n}"
    assert entry_name(ptx) == "_Z1kPx" and entry_params(ptx) == ["u64", "f32"]
    with pytest.raises(RuntimeError, match="entry"):
        entry_name(ptx + ptx)


def _ids_ptx():
    kernel, _ = ids_cuda.ids_kernel(3, 8)
    args = (np.zeros(4, np.int64), np.zeros(2, np.int64), np.zeros((1, 2), np.int64),
            ids_cuda.layout_params(_layout(3, 8)), np.int64(3), np.zeros((4, 16), np.int64))
    return build_for(kernel, args).ptx


def test_assemble_links_a_cubin_or_hands_the_driver_the_ptx(monkeypatch):
    """nvJitLink (from numba-cuda's cuda-python) turns the PTX into a cubin, so an NVVM newer
    than the driver still loads; without it, or when it refuses, the PTX goes to the driver
    NUL-terminated (cuModuleLoadData reads a C string)."""
    ptx = _ids_ptx()
    name = entry_name(ptx).encode()
    nvjitlink = pytest.importorskip("cuda.bindings.nvjitlink")
    image = assemble(ptx, (9, 0))
    assert image[:4] == b"\x7fELF" and name in image  # a cubin holding the kernel
    assert assemble(ptx, (8, 0)) != image  # built for the asked architecture
    assert assemble(ptx.replace("mul.hi.u64", "mul.hi.q64"), (9, 0)) == (
        ptx.replace("mul.hi.u64", "mul.hi.q64").encode() + b"\0")  # refused: the driver's turn
    def missing_library(*args):
        raise RuntimeError("libnvJitLink.so not found")

    monkeypatch.setattr(nvjitlink, "create", missing_library)
    assert assemble(ptx, (9, 0)) == ptx.encode() + b"\0"
    monkeypatch.delattr(sys.modules["cuda.bindings"], "nvjitlink")  # not installed at all
    monkeypatch.setitem(sys.modules, "cuda.bindings.nvjitlink", None)
    assert assemble(ptx, (9, 0)) == ptx.encode() + b"\0"


class _FakeDevice:
    """``cupy.cuda.Device()`` of an sm_90 GPU."""

    id, compute_capability = 0, "90"

    def __init__(self, device=None):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


def test_a_launch_loads_once_and_passes_the_flattened_arguments_and_stream(monkeypatch):
    """The CuPy side of a launch, with CuPy's module and device faked (no GPU here)."""
    cupy = pytest.importorskip("cupy")
    loads, launches = [], []

    class Module:
        def load(self, image):
            loads.append(image)

        def get_function(self, name):
            return lambda grid, block, args, stream=None: launches.append(
                (name, grid, block, args, stream))

    monkeypatch.setattr(cupy.cuda, "Device", _FakeDevice)
    monkeypatch.setattr(cupy.cuda.function, "Module", Module)
    layout = _layout(3, 8)
    tokens, starts = np.arange(300, dtype=np.int32), np.array([0, 100, 300], np.int32)
    context = np.zeros((2, 2), np.int32)
    out = np.zeros((300, 16), np.int64)
    stream = object()
    for _ in range(2):
        ids_cuda.launch_ngram_ids(layout, tokens, starts, context, ids_cuda.layout_params(layout),
                                  out, stream=stream)
    assert len(loads) == 1 and len(launches) == 2  # compiled and loaded once per device, types
    name, grid, block, args, passed = launches[0]
    kernel, tokens_per_block = ids_cuda.ids_kernel(3, 8)
    assert grid == (-(-300 // tokens_per_block),) and block == (tokens_per_block,)
    assert passed is stream
    assert len(args) == 2 * 7 + 3 * 9 + 1  # two 1-D arrays (7 slots), three 2-D (9), eos
    assert args[4] is tokens and args[-5] is out and args[-4:] == (300, 16, 128, 8)
    assert name.encode() in loads[0]  # the image holds the entry point launched


class OnGpu(np.ndarray):
    """A host array standing in for a device array on GPU 1 (only its ``device`` differs)."""

    @property
    def device(self):
        return pytypes.SimpleNamespace(id=1)


def test_a_launch_goes_to_the_arrays_gpu_not_the_current_one(monkeypatch):
    """Bug: kernels were loaded and launched on the current device; a module loaded for GPU 1
    cannot launch in GPU 0's context, and GPU 0 cannot read GPU 1's arrays anyway."""
    from fake_cupy import FakeCupy

    cupy = FakeCupy()
    monkeypatch.setattr(cuda_launch, "cupy_module", lambda: cupy)
    kernel = cuda_launch.NumbaKernel(lambda out: None)
    out = np.zeros(4, np.int64).view(OnGpu)
    launched = []
    kernel._functions[(1, cuda_launch._signature_key((out,)))] = (
        lambda grid, block, args, stream=None: launched.append(cupy.current))
    kernel(1, 32, (out,))
    assert launched == [1] and cupy.current == 0


def test_numba_cuda_compiles_with_a_numpy_that_dropped_row_stack():
    """NumPy 2.5 removed ``np.row_stack``, which numba-cuda 0.30 overloads at its first compile:
    once the launcher is imported, kernels compile on such a NumPy (a fresh process, since the
    overloads register once per process)."""
    code = """
import warnings
import numpy as np
warnings.simplefilter("ignore", DeprecationWarning)
if "row_stack" in vars(np) or hasattr(np, "row_stack"):
    delattr(np, "row_stack")
from ngram_cupy.runtime import cuda_launch
from numba import cuda
def kernel(x):
    x[0] = 1.0
print(".entry" in cuda.compile_ptx(kernel, "void(float32[:])", cc=(8, 0))[0])
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert run.stdout.strip() == "True", run.stderr[-3000:]
