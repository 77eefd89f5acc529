"""``ngram_cupy.torch``: PLE layers as ``torch.nn.Module`` (``module.py``), their table weights
(``TableWeights``) and the fused sparse optimizers (``autograd.py``)."""

from .autograd import fused_optimizer
from .module import (
    NGramEmbeddingModule,
    TableWeights,
    batch_arguments,
    layer_key,
    seed_call_shape,
    stored_rows_format,
)

__all__ = ["NGramEmbeddingModule", "TableWeights", "batch_arguments", "fused_optimizer",
           "layer_key", "seed_call_shape", "stored_rows_format"]
