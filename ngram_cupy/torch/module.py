"""``NGramEmbeddingModule``: one PLE layer as a ``torch.nn.Module`` shaped like the reference layer.

A model written for the reference layer can use it in its place: the same ``forward`` and
``start_prefetch`` arguments (vLLM 0.33's three, or the seed's four with ``hidden_states``
first), the same ``[T, num_heads * head_dim]`` output, the same checkpoint names in
``load_weights`` and the same ``state_dict`` keys; with ``return_stored_rows=True`` it returns
the stored rows that vLLM 0.33's PLE layer decodes with ``ngram_embedding.dequantize(rows,
dtype)``. Underneath it is an ``NGramEmbedding`` (exact ids, then an ``EmbeddingTable`` gather),
so CPU tensors run on the CPU and CUDA tensors on the GPU, on torch's current stream.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..embedding import NGramEmbedding
from ..formats import default_output, output_format
from ..hashing.config import NGramConfig
from ..hashing.layout import layer_layout
from ..tables.storage import place_filled, placement_named
from ..tables.table import EmbeddingTable
from .call_shapes import seed_call_shape
from .layer import LayerStep, SteppedLayer
from .loading import WeightLoading
from .placement import default_placement
from .weights import storage_view, stored_rows_format

_TORCH_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class NGramEmbeddingModule(SteppedLayer, torch.nn.Module):
    """Dense PLE layer ``layer`` of ``config``: ids of a packed batch, then their table rows,
    with vLLM 0.33's layer shape (``forward(input_ids, query_start_loc, ngram_context)``), or
    the seed reference layer's with ``hidden_states`` first (``seed_call_shape``).

    Args:
        config: the model's :class:`~ngram_cupy.NGramConfig`; it must set ``embedding_dim``.
        layer: the PLE layer, counted from 0 (``config.ple_layer_ids[layer]`` is its decoder
            layer, counted from 1).
        placement: ``"gpu"`` (device memory; a ValueError without CuPy and a CUDA device),
            ``"pinned"`` (host memory the GPU reads), ``"cpu"``, or ``"shared"``: rows load into
            private memory, then, once every shard is in, move into the node's shared segment
            named by their content (the first process fills it, the others attach) and stay
            read-only. Default None: ``"gpu"`` where CuPy sees a CUDA device, else ``"cpu"``
            with a ``CpuPlacementWarning`` given once per process.
        weight_dtype: the table's storage type: float32, float16, bfloat16, float8_e4m3fn (also
            ``"fp8"``), ``"nvfp4"`` or ``"mxfp8"``, as a torch dtype or a name. Default None:
            ``config.ple_embedding_dtype``, else torch's default dtype, as the reference layer.
        hot_rows: sorted unique row ids (e.g. ``ngram-cupy stats --save-hot-rows``; placement
            ``"pinned"`` or ``"cpu"``) served from a hot tier (GPU memory for a pinned table);
            every load path keeps it current; after changing ``ngram_embedding.weight`` in
            place call ``refresh_hot_rows()``. Default None.
        return_stored_rows: ``forward`` returns float8 rows as stored (unscaled, float8), for
            ``dequantize`` to decode, as vLLM 0.33's layer does (default False); block-scaled
            rows come back decoded.
        scale_rounding: ``"output"`` (default, as vLLM 0.33) or ``"float32"``
            (see :class:`~ngram_cupy.EmbeddingTable`).
        out_dtype: the lookups' dtype: bfloat16, float16 or float32 (a torch dtype or name).
            Default None: bfloat16 for float8, bfloat16 and block-scaled tables, else the
            storage type; NVFP4 rows are rounded once, to it.
        trainable: ``True`` (float32 or bfloat16 rows in ``"cpu"``, ``"pinned"``, ``"gpu"`` or
            ``"shared"``, Hogwild): ``ngram_embedding.weight`` is a parameter sharing the rows,
            and a backward through ``forward`` gives it a sparse gradient, or steps the optimizer
            that ``fused_optimizer(module, ...)`` attached (docs/training.md). Default False.

    Returns:
        The module; the table is allocated here and filled by ``load_weights(pairs)`` (the
        checkpoint's names relative to the layer) or ``load_state_dict``; ``forward`` gives
        ``[T, num_heads * head_dim]``.
    """

    def __init__(self, config: NGramConfig, layer: int, *, placement: str | None = None,
                 weight_dtype: torch.dtype | str | None = None, hot_rows=None,
                 return_stored_rows: bool = False, scale_rounding: str = "output",
                 out_dtype: torch.dtype | str | None = None, trainable: bool = False):
        super().__init__()
        if not isinstance(config, NGramConfig):
            raise TypeError(f"config must be an NGramConfig, got {type(config).__name__}")
        if config.head_dim is None:
            raise ValueError("config has no embedding_dim (ple_embed_dim): the table size is "
                             "unknown")
        if weight_dtype is None:
            weight_dtype = config.ple_embedding_dtype or torch.get_default_dtype()
        layout = layer_layout(config, layer)
        self._placement = placement_named(default_placement() if placement is None else placement)
        self._share_when_loaded = self._placement.fills != self._placement.name
        self._hot_rows = hot_rows
        table = EmbeddingTable.empty(layout.padded_rows, layout.head_dim, weight_dtype,
                                     placement=self._placement.fills, hot_rows=hot_rows,
                                     scale_rounding=scale_rounding)
        self._placement.check_holds(table.format)
        self.layout = layout
        self.out_dtype = (default_output(table.format) if out_dtype is None
                          else output_format(out_dtype, "out_dtype")).torch_dtype
        self.return_stored_rows = bool(return_stored_rows)
        stored = stored_rows_format(table.format) if self.return_stored_rows else None
        self._stored_format = stored
        self._lookup_dtype = self.out_dtype if stored is None else stored.torch_dtype
        self._kept_sizes: set[int] = set()
        if trainable and self.return_stored_rows:
            raise ValueError("trainable=True needs return_stored_rows=False")
        self.step = LayerStep(self._embedding_over(table))  # what the ops reach by ``handle``
        self.register_buffer("layer_multipliers", torch.tensor(layout.multipliers))
        self.register_buffer("ngram_heads_vocab_sizes", torch.tensor(layout.head_sizes))
        self.register_buffer("ngram_heads_offsets", torch.tensor(layout.head_offsets))
        self.ngram_embedding = self.step.hold(table, trainable)
        self.loading = WeightLoading(layout, self.ngram_embedding)
        self.register_load_state_dict_pre_hook(NGramEmbeddingModule._check_state_dict)
        self.register_load_state_dict_post_hook(NGramEmbeddingModule._share)

    @property
    def allow_missing_weights(self) -> bool:
        """True: look rows up before every shard has arrived (default False)."""
        return self.loading.allow_missing

    @allow_missing_weights.setter
    def allow_missing_weights(self, value: bool) -> None:
        self.loading.allow_missing = value

    @property
    def table(self) -> EmbeddingTable:
        """The embedding table the rows live in."""
        return self.ngram_embedding.table

    @property
    def scale_name(self) -> str | None:
        """The checkpoint name of the table's one scale (``ngram_embedding.weight_scale`` for
        float8, ``ngram_embedding.weight_scale_2`` for NVFP4's global scale), or None."""
        return self.loading.scale_name

    @property
    def missing_shards(self) -> list[int | str]:
        """Indexes of checkpoint shards holding rows that ``load_weights`` has not received yet
        (a block-scaled shard counts once its rows and block scales are in), then the scale's name
        (``scale_name``) when it has not arrived."""
        return self.loading.missing_shards

    def __reduce__(self):
        """Pickle and ``copy.deepcopy`` (a prefetcher's lock and the table's memory cannot be
        copied as they are): the constructor's arguments, the state and what was loaded."""
        arguments = dict(placement=self.table.placement, weight_dtype=self.table.format.name,
                         hot_rows=getattr(self.table.storage, "hot_rows", None),
                         return_stored_rows=self.return_stored_rows,
                         scale_rounding=self.table.scale_rounding,
                         out_dtype=self.out_dtype, trainable=self.trainable_rows is not None)
        loaded = (set(self.loading.loaded_shards), self.loading.scale_loaded,
                  self.allow_missing_weights)
        # As integer bits: torch cannot unpickle float8 tensors (torch 2.13: UntypedStorage).
        state = {name: (value.view(_TORCH_BITS[value.element_size()]), value.dtype)
                 for name, value in self.state_dict().items()}
        return _rebuild, (self.layout.config, self.layout.layer, arguments, state, loaded)

    def _embedding_over(self, table: EmbeddingTable) -> NGramEmbedding:
        """The layer's lookups over ``table``, keeping the staging sizes kept so far. Stored rows
        are gathered unscaled (a second front over the same storage) in a format that holds
        them exactly, then cast back to the storage dtype in ``forward``."""
        if self._stored_format is not None:
            table = EmbeddingTable(table.storage, row_start=table.row_start,
                                   total_rows=table.total_rows)
        embedding = NGramEmbedding(self.layout, table)
        embedding.keep_staging(self._kept_sizes)
        return embedding

    def keep_staging(self, num_tokens: Iterable[int]) -> None:
        """Keep the ids and rows staging buffers of these batch sizes for the module's life:
        call it with every batch size an engine captures in a CUDA graph, before capturing
        (others are dropped beyond the latest ``prefetch.STAGING_SHAPES``)."""
        sizes = list(num_tokens)
        self.embedding.keep_staging(sizes)
        self._kept_sizes.update(int(size) for size in sizes)

    def dequantize(self, rows: torch.Tensor, dtype: torch.dtype | str,
                   block_scales: torch.Tensor | None = None) -> torch.Tensor:
        """``self.ngram_embedding.dequantize`` (``TableWeights.dequantize``): stored rows
        decoded to ``dtype`` exactly as a lookup decodes them."""
        return self.ngram_embedding.dequantize(rows, dtype, block_scales)

    def refresh_hot_rows(self) -> None:
        """Copy the hot tier's rows again from the table (after an in-place weight change; the
        load paths do this themselves). Nothing without ``hot_rows``."""
        self.table.refresh_hot_rows()

    # ---- lookups ----

    @staticmethod
    def _batch(input_ids, query_start_loc, ngram_context):
        """The batch on the device of ``input_ids``, and the CUDA stream to run on (or None)."""
        for name, value in (("input_ids", input_ids), ("query_start_loc", query_start_loc),
                            ("ngram_context", ngram_context)):
            if isinstance(value, torch.Tensor) and value.device.type == "meta":
                raise ValueError(f"{name} is on the meta device: it holds no values to look up")
        input_ids = input_ids.reshape(-1)
        device = input_ids.device
        query_start_loc, ngram_context = query_start_loc.to(device), ngram_context.to(device)
        stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        return input_ids, query_start_loc, ngram_context, stream

    def compute_ngram_ids(self, input_ids: torch.Tensor, query_start_loc: torch.Tensor,
                          ngram_context: torch.Tensor,
                          output: torch.Tensor | None = None) -> torch.Tensor:
        """The ``[T, num_heads]`` int64 row ids of a packed batch (into ``output`` if given)."""
        input_ids, query_start_loc, ngram_context, stream = self._batch(
            input_ids, query_start_loc, ngram_context)
        if output is None:
            output = torch.empty((input_ids.shape[0], self.layout.num_heads), dtype=torch.int64,
                                 device=input_ids.device)
        self.embedding.compute_ids(input_ids, query_start_loc, ngram_context, out=output,
                                   stream=stream)
        return output

    @seed_call_shape
    def forward(self, input_ids: torch.Tensor, query_start_loc: torch.Tensor,
                ngram_context: torch.Tensor) -> torch.Tensor:
        """``[T, num_heads * head_dim]`` embeddings of a packed batch in ``self.out_dtype`` (the
        stored rows with ``return_stored_rows``).

        ``input_ids`` are the batch's tokens (``[T]``, may be padded past
        ``query_start_loc[-1]``, docs/ids.md), ``query_start_loc`` its sequences' starts
        (``[S + 1]``) and ``ngram_context`` each sequence's preceding tokens (``[S, n - 1]``).
        The seed's ``(hidden_states, input_ids, query_start_loc, ngram_context)`` is taken too
        (``seed_call_shape``). After ``start_prefetch`` this joins the prefetch and gathers
        again only heads whose ids changed, so a stale prefetch costs time, never correctness.
        """
        self.loading.check_loaded()
        input_ids, query_start_loc, ngram_context, _ = self._batch(
            input_ids, query_start_loc, ngram_context)
        ids = self.step.ids(input_ids, query_start_loc, ngram_context)
        rows = self.step.lookup(ids, self._lookup_dtype, trainable=self.trainable_rows is not None)
        if self._stored_format is not None and rows.dtype != self.table.format.torch_dtype:
            return rows.to(self.table.format.torch_dtype)  # exact: see stored_rows_format
        return rows

    @seed_call_shape
    def start_prefetch(self, input_ids: torch.Tensor, query_start_loc: torch.Tensor,
                       ngram_context: torch.Tensor) -> None:
        """Start gathering the rows of the batch ``forward`` will be given (vLLM 0.33's call;
        the seed's four arguments too, ``seed_call_shape``) while the preceding decoder layer
        runs (a side CUDA stream, or a worker thread on the CPU); ``forward`` joins it.
        Nothing for a table in GPU memory, as in the reference layer."""
        if self.table.storage.device_resident:
            return
        self.loading.check_loaded()
        input_ids, query_start_loc, ngram_context, _ = self._batch(
            input_ids, query_start_loc, ngram_context)
        self.step.start_prefetch(self.step.ids(input_ids, query_start_loc, ngram_context),
                                 self._lookup_dtype)

    # ---- weights ----

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load ``(name, tensor)`` pairs named as in the checkpoint, relative to the layer.

        Hash buffers are checked against the derived layout; each table shard is copied into
        the table as it arrives (no second copy of the table); the float8 scale is taken;
        ``hashstats_*`` and ``token_lookup`` entries are skipped. Returns the names loaded, with
        shards reported as ``ngram_embedding.weight`` (see ``missing_shards``).
        """
        loaded = self.loading.load_weights(weights)
        self._share()
        return loaded

    def _share(self, *hook_args) -> None:
        """For ``placement="shared"``, once every shard is loaded: the rows into the node's
        segment of their content, the private copy dropped (also a ``load_state_dict`` hook)."""
        if not self._share_when_loaded or self.missing_shards:
            return
        private = self.table
        table = EmbeddingTable(place_filled(self._placement.name, private.storage), private.scale,
                               hot_rows=self._hot_rows, scale_rounding=private.scale_rounding)
        self.step.embedding = self._embedding_over(table)
        self.ngram_embedding.table = table
        if self.trainable_rows is not None:  # the segment trains in place (Hogwild)
            self.trainable_rows.moved_to(table)
        else:
            self.ngram_embedding.weight = storage_view(table, self.ngram_embedding.weight.dtype)
        self._share_when_loaded = False
        private.close()

    def _check_state_dict(self, state_dict, prefix, *args) -> None:
        """Before ``load_state_dict`` puts anything in place: ``WeightLoading.check_state_dict``."""
        self.loading.check_state_dict(state_dict, prefix)

    def extra_repr(self) -> str:
        return (f"layer={self.layout.layer}, heads={self.layout.num_heads}, "
                f"head_dim={self.layout.head_dim}, rows={self.layout.padded_rows}, "
                f"weight_dtype={self.ngram_embedding.weight.dtype}, "
                f"placement={self.table.placement!r}"
                f"{', return_stored_rows=True' if self.return_stored_rows else ''}")


def _rebuild(config: NGramConfig, layer: int, arguments: dict, state: dict,
             loaded: tuple) -> NGramEmbeddingModule:
    """An ``NGramEmbeddingModule`` from what ``__reduce__`` gave (pickle, ``copy.deepcopy``)."""
    module = NGramEmbeddingModule(config, layer, **arguments)
    module.load_state_dict({name: bits.view(dtype) for name, (bits, dtype) in state.items()})
    module.loading.loaded_shards, module.loading.scale_loaded, module.allow_missing_weights = \
        loaded
    return module
