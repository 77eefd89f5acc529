"""ngram_cupy: exact, fast hashed n-gram (per-layer embedding) ids and table lookups."""

from .config import NGramConfig
from .layout import LayerLayout, layer_layout
from .ngram_ids import advance_context, compute_ngram_ids

__all__ = [
    "LayerLayout",
    "NGramConfig",
    "advance_context",
    "compute_ngram_ids",
    "layer_layout",
]

__version__ = "0.1.0"
