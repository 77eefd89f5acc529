"""``to_torch``: a lookup's result as a torch tensor, bfloat16 and float8 included."""

from __future__ import annotations

import numpy as np
import torch

from ..formats import bits_name, find_format
from ..runtime.backends import HOST, where


def to_torch(array) -> torch.Tensor:
    """A torch tensor sharing ``array``'s memory, of its dtype: a NumPy array (bfloat16 and
    float8 from ml_dtypes too, which DLPack cannot carry: their bits move as integers and are
    viewed back) or any DLPack array (CuPy: GPU lookups give bfloat16 as uint16 bits, so call
    ``.view(torch.bfloat16)`` on those)."""
    if isinstance(array, np.ndarray):
        fmt = find_format(array.dtype)
        return HOST.to_torch(array, fmt if bits_name(fmt) is not None else None)
    if where(array) is None:
        raise TypeError(f"array must be a NumPy array or a DLPack array, got "
                        f"{type(array).__name__}")
    return torch.from_dlpack(array)
