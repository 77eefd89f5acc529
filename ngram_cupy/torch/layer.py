"""``LayerStep``: the step both torch layers run, and what their handle names.

``NGramEmbedding``'s framework-free step (ids, the rows started early, then joined or gathered)
as registered torch ops (``ops.py``): the ids op; then the output a prefetch is filling joined,
or a fresh one; then the plain lookup op, or the trainable one that autograd records.
``NGramEmbeddingModule`` (vLLM's call shape) and transformers' ``CachedNGramEmbedding`` differ
only in how they shape a batch and where its context comes from. The ops resolve a layer's
``handle`` (``runtime/handles.py``) to its step and read ``layout``, ``embedding``, ``table``
and ``rows`` from it: one kind of object behind every handle.
"""

from __future__ import annotations

import torch

from ..embedding import NGramEmbedding
from ..hashing.layout import LayerLayout
from ..runtime.handles import register
from ..tables.table import EmbeddingTable
from . import ops
from .autograd import TrainableRows
from .weights import TableWeights


class LayerStep:
    """One torch layer's lookups over ``embedding``, its rows as torch buffers (``weights``,
    where the layer has them), its trainable state (``rows``, or None) and the output of a
    prefetch in flight (``prefetched``)."""

    def __init__(self, embedding: NGramEmbedding):
        self.embedding = embedding  # replaced when the rows move (a shared layer, once loaded)
        self.weights: TableWeights | None = None
        self.rows: TrainableRows | None = None
        self.prefetched: torch.Tensor | None = None  # start_prefetch's output, for lookup
        self.handle = register(self)  # the key the registered ops reach the step by

    @property
    def layout(self) -> LayerLayout:
        """The layer's hash layout."""
        return self.embedding.layout

    @property
    def table(self) -> EmbeddingTable:
        """The table of the stored rows (the weights'; a layer returning stored rows looks them
        up through a second, unscaled front over the same storage: ``embedding.table``)."""
        return self.embedding.table if self.weights is None else self.weights.table

    def hold(self, table: EmbeddingTable, trainable: bool) -> TableWeights:
        """``table``'s rows as the layer's torch buffers (``TableWeights``, in the storage
        dtype, decoding through this step), and with ``trainable`` the parameter over them."""
        self.weights = TableWeights(table, table.format.torch_dtype, self.handle)
        if trainable:
            self.rows = TrainableRows(self.weights, "trainable=True")
        return self.weights

    def ids(self, input_ids: torch.Tensor, query_start_loc: torch.Tensor | None,
            ngram_context: torch.Tensor | None) -> torch.Tensor:
        """The ``[T, num_heads]`` int64 ids of a packed batch (of ``[B, S]`` rows when
        ``query_start_loc`` is None), on the device of ``input_ids``."""
        return ops.ids(self.handle, input_ids, query_start_loc, ngram_context)

    def _empty_rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A fresh ``[T, num_heads * head_dim]`` output of ``dtype``, beside the ids."""
        width = self.layout.num_heads * self.embedding.table.head_dim
        return torch.empty((ids.shape[0], width), dtype=dtype, device=ids.device)

    def start_prefetch(self, ids: torch.Tensor, dtype: torch.dtype) -> None:
        """Start gathering the rows of ``ids`` in ``dtype`` (a side CUDA stream, or a CPU
        worker) into an output that the next ``lookup`` joins."""
        self.prefetched = self._empty_rows(ids, dtype)
        ops.prefetch(self.handle, ids, self.prefetched)

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype, *, trainable: bool) -> torch.Tensor:
        """The rows of ``ids`` in ``dtype``: joining the prefetch when it was of this batch,
        else into a fresh output; ``trainable``: recorded for autograd (``trainable_lookup``,
        which gathers again the tokens a prefetch may have read before an update)."""
        out, self.prefetched = self.prefetched, None
        if trainable:
            return ops.trainable_lookup(self.handle, self.rows.weights.weight, ids, dtype,
                                        self.rows.optimizer is not None)
        if out is None or out.shape[0] != ids.shape[0] or out.device != ids.device \
                or out.dtype != dtype:
            out = self._empty_rows(ids, dtype)
        return ops.lookup(self.handle, ids, out)


class SteppedLayer:
    """What a torch layer running a ``LayerStep`` (its ``step``) answers through it."""

    step: LayerStep

    @property
    def handle(self) -> int:
        """The key the registered ops reach the layer's step by (``runtime/handles.py``)."""
        return self.step.handle

    @property
    def embedding(self) -> NGramEmbedding:
        """The layer's lookups (the framework-free ``NGramEmbedding``)."""
        return self.step.embedding

    @property
    def trainable_rows(self) -> TrainableRows | None:
        """With ``trainable=True``, the ``TrainableRows`` (autograd.py); else None."""
        return self.step.rows
