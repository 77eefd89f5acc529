"""Where ``NGramEmbeddingModule`` puts its table unless told: the GPU where there is one."""

from __future__ import annotations

import warnings
from functools import cache

from ..runtime.backends import gpu_available


class CpuPlacementWarning(UserWarning):
    """No CuPy or no CUDA device: a layer built without ``placement`` keeps its table on the
    CPU."""


@cache
def default_placement() -> str:
    """``"gpu"`` where CuPy sees a CUDA device, else ``"cpu"`` with a warning given once per
    process (cached): a model built on a machine without a GPU still runs, and says so."""
    if gpu_available():
        return "gpu"
    warnings.warn("no CUDA device (or no CuPy): NGramEmbeddingModule tables default to "
                  "placement='cpu'; pass placement= to choose, and to silence this",
                  CpuPlacementWarning, stacklevel=3)
    return "cpu"
