"""``ngram-cupy info``: the version and the backends a run would use."""

from __future__ import annotations

import argparse
import os
import sys

from ..runtime.backends import gpu_available
from .common import PROG


def describe_backend() -> list[str]:
    """The library's version and the backends a run would use: CPU threads and Numba's
    threading layer, CuPy and the GPU (or none), the kernel cache folder."""
    import numba
    import numpy as np

    from .._version import package_version
    from ..runtime.cpu_threads import threading_layer

    lines = [f"{PROG} {package_version()} (Python {sys.version.split()[0]}, "
             f"NumPy {np.__version__}, Numba {numba.__version__})",
             f"CPU: {numba.get_num_threads()} threads of {os.cpu_count()} cores, Numba threading "
             f"layer {threading_layer()}"]
    try:
        import cupy
    except ImportError:
        lines.append("GPU: none (CuPy is not installed: the cuda12 or cuda13 extra)")
    else:
        if gpu_available():
            name = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
            lines.append(f"GPU: {name} ({cupy.cuda.runtime.getDeviceCount()} device(s)), CuPy "
                         f"{cupy.__version__}")
        else:
            lines.append(f"GPU: none (CuPy {cupy.__version__} sees no usable CUDA device)")
    from ..runtime.kernel_cache import CACHE_ENV, cache_dir

    cache = cache_dir()
    where = "set by " + CACHE_ENV if os.environ.get(CACHE_ENV) else "default; set " + CACHE_ENV
    lines.append(f"kernel cache folder: {cache} ({where})")
    return lines


def cmd_info(args: argparse.Namespace) -> int:
    """Print the version and the backends in use."""
    print("\n".join(describe_backend()))
    return 0


def add_parser(commands) -> None:
    """Add the ``info`` command to the sub-parsers ``commands``."""
    info = commands.add_parser("info", help="print the version and the backends in use",
                               description="The version, CPU threads and Numba's threading "
                               "layer, CuPy and the GPU (or none), and the kernel cache folder.")
    info.set_defaults(run=cmd_info)
