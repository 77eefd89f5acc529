"""ngram_cupy: exact, fast hashed n-gram (per-layer embedding) ids and table lookups."""

from .checkpoint import load_ngram_embedding, save_ngram_embedding
from .config import NGramConfig
from .distributed import ShardedLookup
from .embedding import NGramEmbedding
from .layout import LayerLayout, layer_layout
from .ngram_ids import advance_context, compute_ngram_ids
from .placement import PlacementPlan, plan_placement
from .table import EmbeddingTable

__all__ = [
    "EmbeddingTable",
    "LayerLayout",
    "NGramConfig",
    "NGramEmbedding",
    "PlacementPlan",
    "ShardedLookup",
    "advance_context",
    "compute_ngram_ids",
    "layer_layout",
    "load_ngram_embedding",
    "plan_placement",
    "save_ngram_embedding",
]

__version__ = "0.1.0"
