"""Per-layer n-gram embeddings: ids of a packed batch, then their table rows.

``NGramEmbedding`` is one Qwen4Exp PLE layer; ``EngramEmbedding`` all DeepSeek Engram layers of
a model, whose ids come for every layer at once.

Mirrors the reference model's module: ``forward`` returns ``[T, num_heads * head_dim]`` vectors and
``prefetch`` (``start_prefetch``) begins the table gather early, during the preceding decoder
layer. NumPy / torch CPU inputs run on the CPU; CuPy / CUDA torch inputs on the GPU; results follow
the inputs (torch in, torch out, without a copy).
"""

from __future__ import annotations

import numpy as np

from .hashing.engram_layout import EngramLayout, check_engram_layout
from .hashing.layout import LayerLayout, check_layout
from .ids.engram_ids import compute_engram_ids
from .ids.ngram_ids import Batch, batch_ids, bind_batch, compute_ngram_ids
from .runtime.backends import DEVICE, Backend
from .runtime.checks import check_integer, check_out
from .tables.prefetch import Buffers
from .tables.table import EmbeddingTable, public_dtype


class NGramEmbedding:
    """The layer: ``layout`` hashes tokens into rows of ``table`` (which may be a row shard).

    Its step, which every face drives (the torch ops call the three parts one by one): the ids
    (``compute_ids``), the rows started early (``prefetch_rows``), then the rows joined or
    gathered (``lookup_rows``); ``forward`` and ``prefetch`` run it on a bound batch.

    ``fused=True`` computes ids and gathers rows in a single GPU launch when no prefetch is
    pending (see ``fused_cuda``; a table with ``hot_rows`` is read tier by tier, as its own
    lookups do); otherwise ``forward`` is ``compute_ids`` then
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
        self._ids_buffers: dict[Backend, Buffers] = {}
        self._keep: set[int] = set()
        self._prefetched = False

    def compute_ids(self, input_ids, query_start_loc, ngram_context, out=None, stream=None):
        """The ``[T, num_heads]`` int64 row ids of a packed batch (``compute_ngram_ids``)."""
        return compute_ngram_ids(self.layout, input_ids, query_start_loc, ngram_context,
                                 out=out, stream=stream)

    def keep_staging(self, num_tokens) -> None:
        """Keep the ids and rows staging buffers of these batch sizes for the layer's life
        (CUDA graphs hold the addresses they captured: call this before capturing)."""
        sizes = [check_integer("num_tokens", n) for n in num_tokens]
        self._keep.update(sizes)
        for buffers in self._ids_buffers.values():
            buffers.pin(self._keep)
        self.table.keep_staging(sizes)

    def _ids(self, batch: Batch):
        """The batch's ids into its ``ids_out``, else into a buffer kept per shape (stable
        under CUDA graphs; lookups copy what they keep, so it is free again at once)."""
        call, shape = batch.call, (batch.num_tokens, self.layout.num_heads)
        out = call["ids_out"]
        if out is not None:
            check_out("ids_out", out, shape, np.int64)
        else:
            if call.side not in self._ids_buffers:
                self._ids_buffers[call.side] = Buffers(call.side.empty)
                self._ids_buffers[call.side].pin(self._keep)
            with call.on():
                out = self._ids_buffers[call.side].get("ids", shape, np.int64)
        return batch_ids(self.layout, batch, out)

    def prefetch_rows(self, ids, out=None, out_dtype=None, stream=None) -> None:
        """Step two of a layer: start gathering the rows of ``ids`` (GPU side stream / CPU
        worker), into ``out`` if given, for ``lookup_rows`` to join."""
        self.table.prefetch(ids, out=out, out_dtype=out_dtype, stream=stream)
        self._prefetched = True

    def lookup_rows(self, ids, out=None, out_dtype=None, stream=None):
        """Step three of a layer: the rows of ``ids`` ``[T, num_heads]``, joining a prefetch
        (only rows whose ids differ from the prefetched ones are gathered again)."""
        self._prefetched = False
        return self.table.lookup(ids, out=out, out_dtype=out_dtype, stream=stream)

    def prefetch(self, input_ids, query_start_loc, ngram_context, stream=None,
                 out_dtype=None) -> None:
        """Compute the ids and start gathering their rows (GPU side stream / CPU worker), in
        ``out_dtype`` (pass the ``forward``'s: a prefetch of another dtype is discarded)."""
        batch = bind_batch(self.layout, stream, input_ids, query_start_loc, ngram_context,
                           ids_out=None)
        self.prefetch_rows(self._ids(batch), out_dtype=out_dtype, stream=batch.call.stream)

    start_prefetch = prefetch

    def forward(self, input_ids, query_start_loc, ngram_context, out=None, out_dtype=None,
                stream=None, ids_out=None):
        """``[T, num_heads * head_dim]`` embeddings of a packed batch (into ``out`` if given;
        the ``[T, num_heads]`` int64 ids into ``ids_out`` if given).

        After ``prefetch`` this joins the prefetch and re-gathers only rows whose ids differ
        from the prefetched ones.
        """
        batch = bind_batch(self.layout, stream, input_ids, query_start_loc, ngram_context,
                           out=out, ids_out=ids_out)
        use_fused = (self.fused and not self._prefetched and batch.call.side is DEVICE
                     and self.table.storage.reads(DEVICE))
        self._prefetched = False
        if use_fused:
            return self._forward_fused(batch, out_dtype)
        call = batch.call
        rows = self.lookup_rows(self._ids(batch), out=call.given["out"], out_dtype=out_dtype,
                                stream=call.stream)
        if call.given["out"] is not None:
            return rows
        out_format, _ = self.table.destination(call.side, (0, 0), None, out_dtype)
        return call.result(rows, out_format)

    __call__ = forward

    def _forward_fused(self, batch: Batch, out_dtype):
        """Ids and rows in one launch (GPU)."""
        from .ids.fused_cuda import fused_lookup_cuda

        call, table = batch.call, self.table
        shape = (batch.num_tokens, self.layout.num_heads)
        out_format, out = table.destination(DEVICE, shape, call["out"], out_dtype,
                                            call.formats.get("out"))
        ids_out = call["ids_out"]
        if ids_out is not None:
            check_out("ids_out", ids_out, shape, np.int64)
        with call.on():
            rows, tier = table.device_rows_on(call.stream)
            result = out
            if result is None:
                result = DEVICE.empty((batch.num_tokens, self.layout.num_heads * table.head_dim),
                                      public_dtype(DEVICE, out_format))
            with result.device:
                fused_lookup_cuda(self.layout, rows, table.format, table.row_start,
                                  table.lookup_scale(out_format),
                                  batch.tokens, batch.query_start_loc, batch.context,
                                  result.view(out_format.raw), out_format.code, ids_out,
                                  call.stream, tier, table.device_scales, table.total_rows)
        return call.result(result, out_format)

    def __repr__(self) -> str:
        return f"NGramEmbedding(layer={self.layout.layer}, table={self.table!r})"


class EngramEmbedding:
    """The Engram layers of one model: ``layout`` hashes tokens into rows of ``tables[i]``, the
    table of Engram layer ``i`` (``layout.layer_ids[i]``; any ``EmbeddingTable`` dtype and
    placement, possibly a row shard).

    A step is ``start_step`` (ids of every layer in one launch, then every layer's rows
    prefetched: GPU side streams, CPU workers), then ``forward(i)`` per layer as the decoder
    reaches it, which joins that layer's prefetch.
    """

    def __init__(self, layout: EngramLayout, tables):
        check_engram_layout(layout)
        tables = list(tables)
        if len(tables) != layout.num_layers:
            raise ValueError(f"tables must hold one table per Engram layer "
                             f"({layout.num_layers}), got {len(tables)}")
        for i, table in enumerate(tables):
            if not isinstance(table, EmbeddingTable):
                raise TypeError(f"tables[{i}] must be an EmbeddingTable, got "
                                f"{type(table).__name__}")
            if table.total_rows != layout.rows_per_layer[i]:
                raise ValueError(f"tables[{i}].total_rows={table.total_rows} must equal "
                                 f"engram_num_embeddings[{i}]={layout.rows_per_layer[i]}")
            if table.head_dim != layout.head_dim:
                raise ValueError(f"tables[{i}].head_dim={table.head_dim} must equal "
                                 f"engram_head_dim={layout.head_dim}")
        self.layout = layout
        self.tables = tables
        self._ids = None

    def compute_ids(self, input_ids, positions, query_start_loc, lookback_token_ids=None,
                    dead_mask=None, lookback_dead_mask=None, out=None, *, stream=None):
        """The ``[T, L, H]`` int32 ids of a packed batch (``compute_engram_ids``)."""
        return compute_engram_ids(self.layout, input_ids, positions, query_start_loc,
                                  lookback_token_ids, dead_mask, lookback_dead_mask, out,
                                  stream=stream)

    def start_step(self, input_ids, positions, query_start_loc, lookback_token_ids=None,
                   dead_mask=None, lookback_dead_mask=None, *, out_dtype=None, stream=None):
        """Compute the step's ids for all layers, start gathering every layer's rows, and
        return the ids (``forward`` uses them until the next step)."""
        ids = self.compute_ids(input_ids, positions, query_start_loc, lookback_token_ids,
                               dead_mask, lookback_dead_mask, stream=stream)
        for layer, table in enumerate(self.tables):
            table.prefetch(ids[:, layer], out_dtype=out_dtype, stream=stream)
        self._ids = ids
        return ids

    def forward(self, layer: int, ids=None, out=None, out_dtype=None, stream=None):
        """``[T, H * head_dim]`` rows of Engram layer ``layer`` (0-based among the Engram
        layers) for ``ids[T, L, H]``, by default the ids of the last ``start_step``."""
        layer = check_integer("layer", layer)
        if not 0 <= layer < self.layout.num_layers:
            raise ValueError(f"layer must lie in [0, {self.layout.num_layers}), got {layer}")
        ids = self._ids if ids is None else ids
        if ids is None:
            raise ValueError("no ids: call start_step first, or pass ids")
        if not hasattr(ids, "shape"):
            raise TypeError(f"ids must be an array [T, L, H] (NumPy, CuPy or torch), got "
                            f"{type(ids).__name__}")
        if ids.ndim != 3 or tuple(ids.shape[1:]) != (self.layout.num_layers,
                                                    self.layout.num_heads):
            raise ValueError(f"ids must have shape [T, {self.layout.num_layers}, "
                             f"{self.layout.num_heads}], got {tuple(ids.shape)}")
        return self.tables[layer].lookup(ids[:, layer], out=out, out_dtype=out_dtype,
                                         stream=stream)

    __call__ = forward

    def __repr__(self) -> str:
        return f"EngramEmbedding(layers={list(self.layout.layer_ids)}, tables={self.tables!r})"
