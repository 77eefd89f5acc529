"""Sparse row gradients: the distinct rows a batch touched and the summed gradient of each."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class SparseRows:
    """``indices`` (int64 ``[U]``, sorted, unique global rows) and ``values`` (float32 ``[U, D]``,
    each row's gradient summed in float64 and rounded once), NumPy or CuPy."""

    indices: Any
    values: Any

    def __len__(self) -> int:
        return int(self.indices.shape[0])

    @property
    def head_dim(self) -> int:
        """Values per row."""
        return int(self.values.shape[1])
