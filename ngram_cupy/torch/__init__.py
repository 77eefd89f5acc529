"""``ngram_cupy.torch``: PLE layers as ``torch.nn.Module`` (``module.py``; transformers' cached
layer: ``cached.py``) over their table weights (``weights.py``, loaded by ``loading.py``),
called in either layer shape (``call_shapes.py``), trained with the fused sparse optimizers
(``autograd.py``); ``to_torch`` hands any result to torch (``arrays.py``),
``default_placement`` says where a layer goes unless told (``placement.py``). Both layers run
one step (``layer.py``) of registered torch ops (``ops.py``), which ``torch.compile`` sees;
``opcheck_samples`` (``opcheck.py``) exercises each."""

from .arrays import to_torch
from .autograd import fused_optimizer
from .call_shapes import batch_arguments, seed_call_shape
from .module import NGramEmbeddingModule
from .opcheck import opcheck_samples
from .placement import CpuPlacementWarning, default_placement
from .weights import TableWeights, layer_key, stored_rows_format

__all__ = ["CpuPlacementWarning", "NGramEmbeddingModule", "TableWeights", "batch_arguments",
           "default_placement", "fused_optimizer", "layer_key", "opcheck_samples",
           "seed_call_shape", "stored_rows_format", "to_torch"]
