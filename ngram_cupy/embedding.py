"""One per-layer n-gram embedding: ids of a packed batch, then their table rows.

Mirrors the reference model's module: ``forward`` returns ``[T, num_heads * head_dim]`` vectors and
``start_prefetch`` begins the (host table) gather early, during the preceding decoder layer.
NumPy / torch CPU inputs run on the CPU; CuPy / CUDA torch inputs on the GPU, and the CuPy
results go to PyTorch without a copy (``torch.from_dlpack``).
"""

from __future__ import annotations

import contextlib

import numpy as np

from .arrays import DEVICE, convert, cuda_stream, placement
from .checks import check_destination, check_layout, check_out
from .layout import LayerLayout
from .ngram_ids import _batch, compute_ngram_ids
from .prefetch import Buffers
from .table import EmbeddingTable, _empty, _unwrap, staging_buffers


class NGramEmbedding:
    """The layer: ``layout`` hashes tokens into rows of ``table`` (which may be a row shard).

    ``fused=True`` computes ids and gathers rows in a single GPU launch when no prefetch is
    pending (see ``fused_cuda``); otherwise ``forward`` is ``compute_ids`` then
    ``table.lookup``.
    """

    def __init__(self, layout: LayerLayout, table: EmbeddingTable, *, fused: bool = False):
        check_layout(layout)
        if not isinstance(table, EmbeddingTable):
            raise TypeError(f"table must be an EmbeddingTable, got {type(table).__name__}")
        if table.total_rows != layout.padded_rows:
            raise ValueError(f"table.total_rows={table.total_rows} must equal the layout's "
                             f"padded_rows={layout.padded_rows}")
        if layout.head_dim is not None and table.head_dim != layout.head_dim:
            raise ValueError(f"table.head_dim={table.head_dim} must equal the layout's "
                             f"head_dim={layout.head_dim}")
        self.layout = layout
        self.table = table
        self.fused = fused
        self._ids_buffers: dict[str, Buffers] = {}
        self._prefetched = False

    def compute_ids(self, input_ids, query_start_loc, ngram_context, out=None, stream=None):
        """The ``[T, num_heads]`` int64 row ids of a packed batch (``compute_ngram_ids``)."""
        return compute_ngram_ids(self.layout, input_ids, query_start_loc, ngram_context,
                                 out=out, stream=stream)

    def _ids(self, input_ids, query_start_loc, ngram_context, stream, ids_out=None):
        """Ids into ``ids_out``, else into a buffer kept per shape (stable under CUDA graphs;
        lookups copy what they keep, so it is free again at once)."""
        check_destination("ids_out", ids_out)
        if ids_out is not None or np.ndim(input_ids) != 1:  # (compute_ids names the problem)
            return self.compute_ids(input_ids, query_start_loc, ngram_context, out=ids_out,
                                    stream=stream)
        side = placement(input_ids=input_ids, query_start_loc=query_start_loc,
                         ngram_context=ngram_context)
        if side not in self._ids_buffers:
            self._ids_buffers[side] = staging_buffers(side)
        shape = (len(input_ids), self.layout.num_heads)
        with cuda_stream(stream) if side == DEVICE else contextlib.nullcontext():
            buffer = self._ids_buffers[side].get("ids", shape, np.int64)
        return self.compute_ids(input_ids, query_start_loc, ngram_context, out=buffer,
                                stream=stream)

    def start_prefetch(self, input_ids, query_start_loc, ngram_context, stream=None) -> None:
        """Compute the ids and start gathering their rows (GPU side stream / CPU worker)."""
        ids = self._ids(input_ids, query_start_loc, ngram_context, stream)
        self.table.prefetch(ids, stream=stream)
        self._prefetched = True

    def forward(self, input_ids, query_start_loc, ngram_context, out=None, out_dtype=None,
                stream=None, ids_out=None):
        """``[T, num_heads * head_dim]`` embeddings of a packed batch (into ``out`` if given;
        the ``[T, num_heads]`` int64 ids into ``ids_out`` if given).

        After ``start_prefetch`` this joins the prefetch and re-gathers only rows whose ids
        differ from the prefetched ones.
        """
        use_fused = (self.fused and not self._prefetched
                     and self.table.device_rows is not None
                     and placement(input_ids=input_ids) == DEVICE)
        self._prefetched = False
        if use_fused:
            return self._forward_fused(input_ids, query_start_loc, ngram_context, out, out_dtype,
                                       stream, ids_out)
        ids = self._ids(input_ids, query_start_loc, ngram_context, stream, ids_out)
        return self.table.lookup(ids, out=out, out_dtype=out_dtype, stream=stream)

    __call__ = forward

    def _forward_fused(self, input_ids, query_start_loc, ngram_context, out, out_dtype, stream,
                       ids_out):
        """Ids and rows in one launch (GPU)."""
        from .fused_cuda import fused_lookup_cuda

        check_destination("ids_out", ids_out)
        caller_out = out
        out, out_torch_dtype = _unwrap(out)
        stream, (tokens, starts, context), out, num_tokens, _ = _batch(
            self.layout, stream, input_ids, query_start_loc, ngram_context, out)
        shape = (num_tokens, self.layout.num_heads)
        out_format, out = self.table.destination(DEVICE, shape, out, out_dtype, out_torch_dtype)
        if ids_out is not None:
            with stream:
                side, arrays = convert(ids_out=ids_out)
            if side != DEVICE:
                raise ValueError("ids_out must be on the GPU, like the batch")
            ids_out = arrays["ids_out"]
            check_out("ids_out", ids_out, shape, np.int64)
        result = out
        with stream:
            if result is None:
                result = _empty(DEVICE)((num_tokens, self.layout.num_heads * self.table.head_dim),
                                        dtype=self.table.public_dtype(DEVICE, out_format))
            with result.device:
                fused_lookup_cuda(self.layout, self.table, tokens, starts, context,
                                  result.view(out_format.raw), out_format.code, ids_out, stream)
        return result if caller_out is None else caller_out

    def __repr__(self) -> str:
        return f"NGramEmbedding(layer={self.layout.layer}, table={self.table!r})"

