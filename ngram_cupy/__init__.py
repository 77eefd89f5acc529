"""ngram_cupy: exact, fast hashed n-gram (per-layer embedding) ids and table lookups.

Names are imported on first use (PEP 562), so ``import ngram_cupy`` stays light: Numba, the
safetensors reader, tqdm, torch and CuPy load only with the parts that need them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import package_version

# Each public name and the module that defines it.
_EXPORTS = {
    "Adam": "training.optimizers",
    "EmbeddingTable": "tables.table",
    "EngramConfig": "hashing.engram_config",
    "EngramEmbedding": "embedding",
    "EngramLayout": "hashing.engram_layout",
    "LayerLayout": "hashing.layout",
    "NGramConfig": "hashing.config",
    "NGramEmbedding": "embedding",
    "PlacementPlan": "tables.plan",
    "RowwiseAdagrad": "training.optimizers",
    "SGD": "training.optimizers",
    "QuantizedTable": "codecs.quantize",
    "ShardedLookup": "distributed.lookup",
    "SharedMemoryFallbackWarning": "memory.shared",
    "SparseRows": "training.sparse_rows",
    "ShardedOptimizer": "distributed.optimizer",
    "advance_context": "ids.ngram_ids",
    "advance_engram_lookback": "ids.engram_ids",
    "compute_engram_ids": "ids.engram_ids",
    "compute_ngram_ids": "ids.ngram_ids",
    "embedding_backward": "training.backward",
    "engram_layout": "hashing.engram_layout",
    "engram_token_map": "hashing.token_map",
    "layer_layout": "hashing.layout",
    "load_engram_embedding": "files.engram_checkpoint",
    "load_ngram_embedding": "files.checkpoint",
    "load_training_state": "training.state_files",
    "plan_placement": "tables.plan",
    "quantize_table": "codecs.quantize",
    "save_engram_embedding": "files.engram_checkpoint",
    "save_ngram_embedding": "files.checkpoint_writing",
    "save_training_state": "training.state_files",
}

__all__ = [
    "Adam",
    "EmbeddingTable",
    "EngramConfig",
    "EngramEmbedding",
    "EngramLayout",
    "LayerLayout",
    "NGramConfig",
    "NGramEmbedding",
    "PlacementPlan",
    "RowwiseAdagrad",
    "SGD",
    "QuantizedTable",
    "ShardedLookup",
    "SharedMemoryFallbackWarning",
    "SparseRows",
    "ShardedOptimizer",
    "advance_context",
    "advance_engram_lookback",
    "compute_engram_ids",
    "compute_ngram_ids",
    "embedding_backward",
    "engram_layout",
    "engram_token_map",
    "layer_layout",
    "load_engram_embedding",
    "load_ngram_embedding",
    "load_training_state",
    "plan_placement",
    "quantize_table",
    "save_engram_embedding",
    "save_ngram_embedding",
    "save_training_state",
]


if TYPE_CHECKING:
    from .codecs.quantize import QuantizedTable, quantize_table
    from .distributed.lookup import ShardedLookup
    from .distributed.optimizer import ShardedOptimizer
    from .embedding import EngramEmbedding, NGramEmbedding
    from .files.checkpoint import load_ngram_embedding
    from .files.checkpoint_writing import save_ngram_embedding
    from .files.engram_checkpoint import load_engram_embedding, save_engram_embedding
    from .hashing.config import NGramConfig
    from .hashing.engram_config import EngramConfig
    from .hashing.engram_layout import EngramLayout, engram_layout
    from .hashing.layout import LayerLayout, layer_layout
    from .hashing.token_map import engram_token_map
    from .ids.engram_ids import advance_engram_lookback, compute_engram_ids
    from .ids.ngram_ids import advance_context, compute_ngram_ids
    from .memory.shared import SharedMemoryFallbackWarning
    from .tables.plan import PlacementPlan, plan_placement
    from .tables.table import EmbeddingTable
    from .training.backward import embedding_backward
    from .training.optimizers import SGD, Adam, RowwiseAdagrad
    from .training.sparse_rows import SparseRows
    from .training.state_files import load_training_state, save_training_state


def __getattr__(name: str) -> Any:
    """Import the module defining ``name`` on first access, and keep the name here
    (``__version__`` is read from the package metadata on first access too)."""
    if name == "__version__":
        globals()[name] = package_version()
        return globals()[name]
    if name not in _EXPORTS:
        raise AttributeError(f"module 'ngram_cupy' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The public names only (``__all__`` and ``__version__``), imported or not."""
    return sorted([*__all__, "__version__"])
