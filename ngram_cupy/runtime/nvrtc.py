"""CUDA C to a cubin with NVRTC (cuda-bindings, which numba-cuda brings): no GPU needed.

CuPy's ``RawModule`` compiles too, but only with a device present; compiling here lets
``ngram-cupy compile`` fill the kernel cache on a machine without one.
"""

from __future__ import annotations

from functools import cache


def nvrtc_module():
    """``cuda.bindings.nvrtc``; ImportError when cuda-bindings or its NVRTC is missing."""
    from cuda.bindings import nvrtc

    return nvrtc


@cache
def nvrtc_version() -> str:
    """NVRTC's version, ``major.minor`` (``none`` without NVRTC)."""
    try:
        nvrtc = nvrtc_module()
        error, major, minor = nvrtc.nvrtcVersion()
    except Exception:  # no cuda-bindings, or no libnvrtc to load
        return "none"
    return f"{major}.{minor}" if error == nvrtc.nvrtcResult.NVRTC_SUCCESS else "none"


def compile_cubin(source: str, name: str, expressions: list[str], arch: str,
                  options: tuple[str, ...]) -> tuple[bytes, dict[str, str]]:
    """``(cubin, {expression: lowered name})`` of ``source`` for ``arch`` (``sm_90``); a
    RuntimeError with NVRTC's log when it does not compile."""
    nvrtc = nvrtc_module()

    def check(result):
        error, *values = result
        if error != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"NVRTC: {error!r}")
        return values[0] if values else None

    flags = [f"-arch={arch}".encode(), *(o.encode() for o in options)]
    program = check(nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], []))
    try:
        for expression in expressions:
            check(nvrtc.nvrtcAddNameExpression(program, expression.encode()))
        try:
            check(nvrtc.nvrtcCompileProgram(program, len(flags), flags))
        except RuntimeError:
            log = b" " * check(nvrtc.nvrtcGetProgramLogSize(program))
            check(nvrtc.nvrtcGetProgramLog(program, log))
            raise RuntimeError(f"{name} does not compile for {arch}:\n"
                               f"{log.rstrip(b' ').decode(errors='replace')}") from None
        cubin = b" " * check(nvrtc.nvrtcGetCUBINSize(program))
        check(nvrtc.nvrtcGetCUBIN(program, cubin))
        lowered = {e: check(nvrtc.nvrtcGetLoweredName(program, e.encode())).decode()
                   for e in expressions}
        return cubin, lowered
    finally:
        check(nvrtc.nvrtcDestroyProgram(program))
