"""``ngram_cupy.torch``: PLE layers as ``torch.nn.Module`` (``module.py``) over their table
weights (``weights.py``), called in either layer shape (``call_shapes.py``), trained with the
fused sparse optimizers (``autograd.py``)."""

from .autograd import fused_optimizer
from .call_shapes import batch_arguments, seed_call_shape
from .module import NGramEmbeddingModule
from .weights import TableWeights, layer_key, stored_rows_format

__all__ = ["NGramEmbeddingModule", "TableWeights", "batch_arguments", "fused_optimizer",
           "layer_key", "seed_call_shape", "stored_rows_format"]
