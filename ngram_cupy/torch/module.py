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

import re
from collections.abc import Iterable

import numpy as np
import torch

from ..embedding import NGramEmbedding
from ..files.checkpoint_names import BUFFERS
from ..formats import FORMATS, default_output, output_format
from ..hashing.config import NGramConfig
from ..hashing.layout import layer_layout, split_rows
from ..runtime.checks import check_scale
from ..tables.storage import place_filled, placement_named
from ..tables.table import EmbeddingTable
from . import ops as torch_ops
from .autograd import TrainableRows
from .call_shapes import seed_call_shape
from .placement import default_placement
from .weights import TableWeights, layer_key, storage_view, stored_rows_format

WEIGHT = "ngram_embedding.weight"
_TORCH_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_SHARD = re.compile(r"ngram_embedding\.shard_(\d+)\.(\w+)", re.ASCII)
# Every format's scale, by the name the layer gives it (float8: weight_scale; NVFP4: the global
# weight_scale_2).
_SCALES = {f"ngram_embedding.{fmt.layer_names.scale}" for fmt in FORMATS if fmt.scaled}


def _is_ignored(name: str) -> bool:
    """Checkpoint entries the layer never uses: hash statistics and token lookups."""
    leaf = name.rsplit(".", 1)[-1]
    return leaf.startswith("hashstats_") or leaf == "token_lookup"


class NGramEmbeddingModule(torch.nn.Module):
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
        self.embedding = self._embedding_over(table)
        self.handle = torch_ops.register(self)  # the key the registered ops reach the layer by
        self._prefetch_rows: torch.Tensor | None = None  # start_prefetch's, for forward
        self.register_buffer("layer_multipliers", torch.tensor(layout.multipliers))
        self.register_buffer("ngram_heads_vocab_sizes", torch.tensor(layout.head_sizes))
        self.register_buffer("ngram_heads_offsets", torch.tensor(layout.head_offsets))
        self.ngram_embedding = TableWeights(table, table.format.torch_dtype)
        self.register_load_state_dict_pre_hook(NGramEmbeddingModule._check_state_dict)
        self.register_load_state_dict_post_hook(NGramEmbeddingModule._share)
        self._loaded_shards: set[int] = set()
        self._scale_loaded = False
        self.allow_missing_weights = False  # True: look rows up before every shard has arrived
        self._pending: dict[int, dict[str, torch.Tensor]] = {}  # block-scaled shard halves
        self.trainable_rows = None  # trainable=True: see TrainableRows (autograd.py)
        if trainable:
            if self.return_stored_rows:
                raise ValueError("trainable=True needs return_stored_rows=False")
            self.trainable_rows = TrainableRows(self.ngram_embedding, "trainable=True")

    @property
    def table(self) -> EmbeddingTable:
        """The embedding table the rows live in."""
        return self.ngram_embedding.table

    @property
    def scale_name(self) -> str | None:
        """The checkpoint name of the table's one scale (``ngram_embedding.weight_scale`` for
        float8, ``ngram_embedding.weight_scale_2`` for NVFP4's global scale), or None."""
        scale = self.table.format.layer_names.scale
        return None if scale is None else layer_key(scale)

    @property
    def missing_shards(self) -> list[int | str]:
        """Indexes of checkpoint shards holding rows that ``load_weights`` has not received yet
        (a block-scaled shard counts once its rows and block scales are in), then the scale's name
        (``scale_name``) when it has not arrived."""
        parts, rows = self.layout.config.split_ngram_parts, self.layout.padded_rows
        holding_rows = (i for i in range(parts) if len(range(*split_rows(rows, parts, i))))
        missing: list[int | str] = [i for i in holding_rows if i not in self._loaded_shards]
        if self.scale_name is not None and not self._scale_loaded:
            missing.append(self.scale_name)
        return missing

    def _check_loaded(self) -> None:
        """Refuse lookups of a partly loaded table (rows never loaded, or a float8 table without
        its scale), unless ``allow_missing_weights``; a table never loaded is left alone."""
        if self.allow_missing_weights or not (self._loaded_shards or self._scale_loaded):
            return
        missing = self.missing_shards
        if missing:
            shown = ", ".join(map(str, missing[:20])) + (", ..." if len(missing) > 20 else "")
            raise ValueError(
                f"layer {self.layout.layer} is partly loaded: missing {shown} (missing_shards); "
                "load them, or set allow_missing_weights = True to look up what is there")

    def __reduce__(self):
        """Pickle and ``copy.deepcopy`` (a prefetcher's lock and the table's memory cannot be
        copied as they are): the constructor's arguments, the state and what was loaded."""
        arguments = dict(placement=self.table.placement, weight_dtype=self.table.format.name,
                         hot_rows=getattr(self.table.storage, "hot_rows", None),
                         return_stored_rows=self.return_stored_rows,
                         scale_rounding=self.table.scale_rounding,
                         out_dtype=self.out_dtype, trainable=self.trainable_rows is not None)
        loaded = (set(self._loaded_shards), self._scale_loaded, self.allow_missing_weights)
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
        self._check_loaded()
        input_ids, query_start_loc, ngram_context, _ = self._batch(
            input_ids, query_start_loc, ngram_context)
        ids = torch_ops.ids(self.handle, input_ids, query_start_loc, ngram_context)
        out, self._prefetch_rows = self._prefetch_rows, None
        if self.trainable_rows is not None:  # autograd, and exact after a prefetch
            return self.trainable_rows.lookup(ids, self._lookup_dtype)
        if out is None or out.shape[0] != ids.shape[0] or out.device != ids.device:
            width = self.layout.num_heads * self.layout.head_dim
            out = torch.empty((ids.shape[0], width), dtype=self._lookup_dtype, device=ids.device)
        rows = torch_ops.lookup(self.handle, ids, out)
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
        self._check_loaded()
        input_ids, query_start_loc, ngram_context, _ = self._batch(
            input_ids, query_start_loc, ngram_context)
        ids = torch_ops.ids(self.handle, input_ids, query_start_loc, ngram_context)
        rows = torch.empty((ids.shape[0], self.layout.num_heads * self.layout.head_dim),
                           dtype=self._lookup_dtype, device=ids.device)
        torch_ops.prefetch(self.handle, ids, rows)
        self._prefetch_rows = rows

    # ---- weights ----

    def _check_buffer(self, name: str, value: torch.Tensor) -> None:
        """A hash buffer from a checkpoint must equal the derived layout in shape and values."""
        layout = self.layout
        want = dict(zip(BUFFERS, (layout.multipliers, layout.head_sizes, layout.head_offsets),
                        strict=True))[name]
        if tuple(value.shape) != tuple(want.shape):
            raise ValueError(f"{name} has shape {tuple(value.shape)} but layer "
                             f"{self.layout.layer} needs {tuple(want.shape)}")
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise ValueError(f"{name} must be an integer tensor (int64), got {value.dtype}")
        got = value.detach().to("cpu", torch.int64).numpy()
        differ = np.flatnonzero(got != want)
        if differ.size:
            i = int(differ[0])
            raise ValueError(f"{name} differs from the layout of layer {self.layout.layer} first "
                             f"at index {i}: got {int(got[i])}, the layout derives {int(want[i])}")

    def _check_rows(self, name: str, value: torch.Tensor, rows: int) -> None:
        """A block of table rows must be ``[rows, row_width]`` of the storage dtype (``head_dim``
        values; packed formats' ``head_dim / pack`` bytes)."""
        shape = (rows, self.table.format.row_width(self.layout.head_dim))
        if tuple(value.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(value.shape)} but must be {shape}")
        if value.dtype != self.ngram_embedding.weight.dtype:
            raise TypeError(f"{name} has dtype {value.dtype} but the table stores "
                            f"{self.ngram_embedding.weight.dtype} (weight_dtype)")

    def _load_shard(self, name: str, index: int, tensor: str, value: torch.Tensor) -> None:
        """Copy checkpoint shard ``index`` of ``tensor`` (the rows, or their block scales) into
        its rows of the table."""
        parts = self.layout.config.split_ngram_parts
        if index >= parts:
            raise ValueError(f"{name}: shard index {index} is at or past "
                             f"split_ngram_parts={parts}")
        start, stop = split_rows(self.layout.padded_rows, parts, index)
        if self.table.format.layer_names.block_scales:  # rows and block scales written together
            self._load_block_scaled_shard(name, index, tensor, start, stop, value)
            return
        self._check_rows(name, value, stop - start)
        self.table.write_rows(start, value.detach())
        self._loaded_shards.add(index)

    def _load_block_scaled_shard(self, name: str, index: int, tensor: str, start: int,
                                 stop: int, value: torch.Tensor) -> None:
        """Keep one half of a block-scaled shard (rows or block scales) until the other
        arrives, then write both (one shard held at most while a checkpoint streams by)."""
        pending = self._pending.setdefault(index, {})
        fmt = self.table.format
        if tensor == fmt.layer_names.block_scales:
            shape = (stop - start, fmt.scale_width(self.layout.head_dim))
            kind = getattr(torch, fmt.block_scale.name)
            if tuple(value.shape) != shape or value.dtype not in (kind, torch.uint8):
                raise ValueError(f"{name} must be {fmt.block_scale.name} of shape {shape} (one "
                                 f"scale per {fmt.block} values), got {value.dtype} of shape "
                                 f"{tuple(value.shape)}")
            pending["scales"] = value.detach()
        else:
            self._check_rows(name, value, stop - start)
            pending["rows"] = value.detach()
        if len(pending) == 2:
            self.table.write_rows(start, pending["rows"], pending["scales"])
            del self._pending[index]
            self._loaded_shards.add(index)

    def _load_scale(self, name: str, value: torch.Tensor) -> None:
        """The table's one scale (``scale_name``): one floating value."""
        if value.numel() != 1 or not value.dtype.is_floating_point:
            raise ValueError(f"{name} must hold one floating value, got {value.dtype} of shape "
                             f"{tuple(value.shape)}")
        self.ngram_embedding.set_scale(value)
        self._scale_loaded = True

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load ``(name, tensor)`` pairs named as in the checkpoint, relative to the layer.

        Hash buffers are checked against the derived layout; each table shard is copied into
        the table as it arrives (no second copy of the table); the float8 scale is taken;
        ``hashstats_*`` and ``token_lookup`` entries are skipped. Returns the names loaded, with
        shards reported as ``ngram_embedding.weight`` (see ``missing_shards``).
        """
        loaded: set[str] = set()
        fmt = self.table.format
        names = fmt.layer_names
        whole = {layer_key(name) for name in (names.rows, names.block_scales) if name}
        for name, value in weights:
            if _is_ignored(name):
                continue
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
            if value.device.type == "meta":
                raise ValueError(f"{name} is on the meta device: it holds no values to load")
            if name in BUFFERS:
                self._check_buffer(name, value)
            elif (match := _SHARD.fullmatch(name)) and match.group(2) in (names.rows,
                                                                           names.block_scales):
                self._load_shard(name, int(match.group(1)), match.group(2), value)
                name = layer_key(match.group(2))
            elif name == self.scale_name:
                self._load_scale(name, value)
            elif name in whole and names.block_scales:
                sharded = names.sharded()
                raise ValueError(f"{name}: an unsharded {fmt.name} tensor is refused; load "
                                 f"{sharded.rows.format(index='{i}')} and "
                                 f"{sharded.block_scales.format(index='{i}')}")
            elif name in _SCALES:
                raise ValueError(f"unexpected weight {name!r}: the table stores {fmt.name}, "
                                 f"which takes no scale"
                                 + ("" if self.scale_name is None else
                                    f" of that name (its scale is {self.scale_name})"))
            elif name == WEIGHT:
                self._check_rows(name, value, self.layout.padded_rows)
                self.table.write_rows(0, value.detach())
                self._loaded_shards.update(range(self.layout.config.split_ngram_parts))
            else:
                raise ValueError(f"unexpected weight {name!r} for an n-gram embedding layer")
            loaded.add(name)
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
        self.embedding = self._embedding_over(table)
        self.ngram_embedding.table = table
        if self.trainable_rows is not None:  # the segment trains in place (Hogwild)
            self.trainable_rows.moved_to(table)
        else:
            self.ngram_embedding.weight = storage_view(table, self.ngram_embedding.weight.dtype)
        self._share_when_loaded = False
        private.close()

    def _check_state_dict(self, state_dict, prefix, *args) -> None:
        """Before ``load_state_dict`` copies (or ``assign=True`` puts) anything in place: hash
        buffers equal to the layout, the rows of the table's shape and storage dtype, block
        scales of theirs, the table's scale one finite positive value."""
        names = self.table.format.layer_names
        tensors = [layer_key(name) for name in (names.block_scales, names.scale) if name]
        for name in (*BUFFERS, WEIGHT, *tensors):
            value = state_dict.get(prefix + name)
            if isinstance(value, torch.Tensor) and value.device.type == "meta":
                raise ValueError(f"{name} is on the meta device: it holds no values to load")
        for name in BUFFERS:
            if prefix + name in state_dict:
                self._check_buffer(name, state_dict[prefix + name])
        if prefix + WEIGHT in state_dict:
            if not self.table.storage.writable:  # torch would copy into the node's segment
                raise ValueError(f"{WEIGHT}: this layer's rows are in the node's shared segment "
                                 "(placement='shared'), read by every process: they are "
                                 "read-only; load into a new module")
            self._check_rows(WEIGHT, state_dict[prefix + WEIGHT], self.layout.padded_rows)
        if names.block_scales and prefix + layer_key(names.block_scales) in state_dict:
            self._check_block_scales(state_dict[prefix + layer_key(names.block_scales)])
        scale = self.scale_name and state_dict.get(prefix + self.scale_name)
        if isinstance(scale, torch.Tensor):
            if scale.numel() != 1 or not scale.dtype.is_floating_point:  # as load_weights
                raise ValueError(f"{self.scale_name} must hold one floating value, got "
                                 f"{scale.dtype} of shape {tuple(scale.shape)}")
            check_scale(self.scale_name,
                        float(scale.detach().to("cpu", torch.float32).reshape(())))
            state_dict[prefix + self.scale_name] = scale.reshape(())  # the buffer's shape
        if prefix + WEIGHT in state_dict:
            self._loaded_shards.update(range(self.layout.config.split_ngram_parts))
        if self.scale_name is not None and prefix + self.scale_name in state_dict:
            self._scale_loaded = True

    def _check_block_scales(self, scales: torch.Tensor) -> None:
        """A state_dict's block scales: the table's ``[rows, head_dim / block]`` of the block
        scale type (torch would convert other dtypes by value, not bits)."""
        fmt = self.table.format
        shape = (self.layout.padded_rows, fmt.scale_width(self.layout.head_dim))
        dtype = getattr(torch, fmt.block_scale.name)
        if tuple(scales.shape) != shape or scales.dtype != dtype:
            raise ValueError(f"{layer_key(fmt.layer_names.block_scales)} must be {dtype} of "
                             f"shape {shape} (one scale per "
                             f"{fmt.block} values), got {scales.dtype} of shape "
                             f"{tuple(scales.shape)}")

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
    module._loaded_shards, module._scale_loaded, module.allow_missing_weights = loaded
    return module
