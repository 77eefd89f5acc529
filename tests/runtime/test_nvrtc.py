"""GPU code compiles for sm_80 and sm_90 without a GPU: kernels/*.cu through NVRTC, the fused
Numba kernel through NVVM (its own file, so that pytest-xdist runs these long compiles beside the
gather tests rather than after them)."""

from __future__ import annotations

import re

import kernel_builds
import numpy as np
import pytest
from numba import types

from ngram_cupy.codecs import dequant
from ngram_cupy.codecs.dequant import FORMATS
from ngram_cupy.ids import fused_cuda
from ngram_cupy.tables import gather_cupy

KERNELS = sorted(gather_cupy.KERNEL_DIR.glob("*.cu"))
# Template instantiations each kernels/*.cu must compile (files without templates: none).
INSTANCES = {"gather.cu": gather_cupy.all_instances()}


# ---------------------------------------------------------------- NVRTC, no GPU needed


def nvrtc_compile(source: str, name: str, expressions: list[str], options: list[str]):
    """``(ptx, {expression: lowered name})`` from NVRTC (cuda-bindings, which numba-cuda brings
    with the NVRTC of its CUDA major); pytest.fail with NVRTC's log on an error."""
    nvrtc = pytest.importorskip("cuda.bindings.nvrtc")

    def check(result):
        error, *values = result
        if error != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"NVRTC: {error!r}")
        return values[0] if values else None

    program = check(nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], []))
    try:
        for expression in expressions:
            check(nvrtc.nvrtcAddNameExpression(program, expression.encode()))
        try:
            check(nvrtc.nvrtcCompileProgram(program, len(options), [o.encode() for o in options]))
        except RuntimeError:
            log = b" " * check(nvrtc.nvrtcGetProgramLogSize(program))
            check(nvrtc.nvrtcGetProgramLog(program, log))
            pytest.fail(f"{name} does not compile ({options}):\n{log.decode()}")
        ptx = b" " * check(nvrtc.nvrtcGetPTXSize(program))
        check(nvrtc.nvrtcGetPTX(program, ptx))
        lowered = {e: check(nvrtc.nvrtcGetLoweredName(program, e.encode())).decode()
                   for e in expressions}
        return ptx.rstrip(b"\0 ").decode(), lowered
    finally:
        check(nvrtc.nvrtcDestroyProgram(program))


@pytest.mark.parametrize("arch", ["compute_80", "compute_90"])
@pytest.mark.parametrize("path", KERNELS, ids=lambda p: p.name)
def test_every_kernel_compiles_with_nvrtc(path, arch):
    names = INSTANCES.get(path.name, [])
    ptx, lowered = nvrtc_compile(gather_cupy.kernel_source(path.name), path.name, names,
                                 [f"-arch={arch}", *gather_cupy.NVRTC_OPTIONS])
    assert ptx.count(".entry") >= max(len(names), 1)
    if path.name == "gather.cu":
        # The released shape's instance loads 16 bytes at a time from the table.
        entry = lowered[gather_cupy.instance_name(dequant.FLOAT8_E4M3, dequant.BFLOAT16, 16,
                                                  np.int64)]
        body = ptx[ptx.index(f".entry {entry}"):]
        body = body[: body.index("\n}\n")]
        assert "ld.global.nc.v4.u32" in body and "st.global.v4.u32" in body
        assert "div.s64" in body and "div.u32" in body  # 64-bit only past 2**31 pieces



@pytest.mark.parametrize("cc", [(8, 0), (9, 0)], ids=str)
@pytest.mark.parametrize("code, out_code, head_dim", [
    (dequant.FLOAT8_E4M3, dequant.BFLOAT16, 160),  # the released rows: 8-byte words
    (dequant.FLOAT32, dequant.FLOAT16, 3),  # 4-byte words (test_cuda_launch shares both builds)
    (dequant.NVFP4, dequant.BFLOAT16, 160),  # NVFP4 rows: 80 bytes, 8-byte words, block scales
])
def test_fused_kernel_ptx(cc, code, out_code, head_dim):
    kernel, _ = fused_cuda.fused_kernel(3, 8, head_dim, code, out_code)
    fmt = FORMATS[code]
    width = fused_cuda.word_bytes(fmt.row_width(head_dim) * fmt.itemsize, fmt.itemsize)
    matrix = lambda dtype: types.Array(dtype, 2, "C")  # noqa: E731
    vector = types.Array(types.int64, 1, "C")
    signature = types.void(vector, vector, matrix(types.int64), matrix(types.int64), types.int64,
                           matrix(getattr(types, f"uint{8 * width}")), types.int64,
                           types.float32, types.boolean, matrix(types.int64),
                           matrix(getattr(types, f"uint{8 * FORMATS[out_code].itemsize}")),
                           matrix(types.uint8), types.int64, types.int64,
                           types.Array(types.uint64, 1, "C"))
    ptx = kernel_builds.build(kernel.py_func, signature.args, cc).ptx
    assert f".target sm_{cc[0]}{cc[1]}" in ptx
    assert "bar.sync" in ptx and "mul.hi.u64" in ptx  # ids staged; division-free modulo
    assert "call" not in ptx[ptx.index(".entry"):]  # every shared helper inlined (NVVM)
    assert re.search(rf"ld\.global(\.nc)?\.[ubf]{8 * width}\b", ptx)  # one load per word
