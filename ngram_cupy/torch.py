"""``NGramEmbeddingModule``: one PLE layer as a ``torch.nn.Module`` shaped like the reference layer.

A model written for the reference layer can use it in its place: the same ``forward`` and
``start_prefetch`` arguments, the same ``[T, num_heads * head_dim]`` output, the same checkpoint
names in ``load_weights`` and the same ``state_dict`` keys. Underneath it is an
``NGramEmbedding`` (exact ids, then an ``EmbeddingTable`` gather), so CPU tensors run on the CPU
and CUDA tensors on the GPU, on torch's current stream.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import numpy as np
import torch

from .embedding import NGramEmbedding
from .files.checkpoint import BUFFERS, check_scale
from .hashing.config import NGramConfig
from .hashing.layout import layer_layout, split_rows
from .tables.formats import default_output
from .tables.table import EmbeddingTable

WEIGHT = "ngram_embedding.weight"
SCALE = "ngram_embedding.weight_scale"
GLOBAL_SCALE = "ngram_embedding.weight_scale_2"  # NVFP4: the float32 global scale
# Value width in bytes -> the NumPy integer type that moves those bits to torch.
_BITS = {1: np.uint8, 2: np.int16, 4: np.int32}
_SHARD = re.compile(r"ngram_embedding\.shard_(\d+)\.weight", re.ASCII)
_SHARD_SCALES = re.compile(r"ngram_embedding\.shard_(\d+)\.weight_scale", re.ASCII)


def _is_ignored(name: str) -> bool:
    """Checkpoint entries the layer never uses: hash statistics and token lookups."""
    leaf = name.rsplit(".", 1)[-1]
    return leaf.startswith("hashstats_") or leaf == "token_lookup"


def _storage_view(table: EmbeddingTable, dtype: torch.dtype) -> torch.Tensor:
    """A torch tensor sharing the table's rows (host or device memory), typed ``dtype``."""
    rows = table.host_view if table.host_view is not None else table.device_rows
    raw = rows.view(_BITS[dtype.itemsize])
    tensor = torch.from_numpy(raw) if isinstance(raw, np.ndarray) else torch.from_dlpack(raw)
    return tensor.view(dtype)


def _scales_view(table: EmbeddingTable) -> torch.Tensor:
    """A torch tensor sharing a block-scaled table's block scales, of their type (NVFP4:
    float8_e4m3fn)."""
    scales = table.host_scales if table.host_scales is not None else table.device_scales
    tensor = torch.from_numpy(scales) if isinstance(scales, np.ndarray) else \
        torch.from_dlpack(scales)
    return tensor.view(getattr(torch, table.format.block_scale.name))


class TableWeights(torch.nn.Module):
    """The table's rows (``weight``) and float8 scale (``weight_scale``) as buffers that share the
    table's memory, so ``state_dict`` reads and ``load_state_dict`` writes the table in place.
    An NVFP4 table's buffers are vLLM's: packed ``weight`` (uint8), block scales
    ``weight_scale`` (float8_e4m3fn, sharing the table's) and the global ``weight_scale_2``."""

    def __init__(self, table: EmbeddingTable, dtype: torch.dtype):
        super().__init__()
        self.table = table
        self.register_buffer("weight", _storage_view(table, dtype))
        if table.format.name == "float8_e4m3fn":
            self.register_buffer("weight_scale", torch.tensor(1.0, dtype=torch.float32))
            table.scale = np.float32(1.0)
        if table.format.blocked:
            self.register_buffer("weight_scale", _scales_view(table))
        if table.format.blocked and table.format.scaled:
            self.register_buffer("weight_scale_2", torch.tensor(1.0, dtype=torch.float32))
            table.scale = np.float32(1.0)
        self.register_load_state_dict_post_hook(TableWeights._after_load)

    def set_global_scale(self, value: torch.Tensor) -> None:
        """Take an NVFP4 table's one-element global scale (finite and positive)."""
        scale = value.detach().to("cpu", torch.float32).reshape(())
        check_scale(GLOBAL_SCALE, float(scale.item()))
        self.weight_scale_2 = scale
        self.table.scale = np.float32(scale.item())

    def set_scale(self, value: torch.Tensor) -> None:
        """Take a one-element floating tensor as the table's scale (finite and positive, as
        the checkpoint loader requires: zero, NaN or a negative scale would corrupt every row)."""
        scale = value.detach().to("cpu", torch.float32).reshape(())
        check_scale(SCALE, float(scale.item()))
        self.weight_scale = scale
        self.table.scale = np.float32(scale.item())

    @staticmethod
    def _after_load(module: TableWeights, incompatible_keys) -> None:
        """After ``load_state_dict`` the table holds the rows and scale just loaded, also when
        ``assign=True`` replaced the buffers instead of copying into them."""
        view = _storage_view(module.table, module.weight.dtype)
        blocked = module.table.format.blocked
        scales = _scales_view(module.table) if blocked else None
        if module.weight.data_ptr() != view.data_ptr() or (
                blocked and module.weight_scale.data_ptr() != scales.data_ptr()):
            module.table.write_rows(0, module.weight.detach(),  # keeps a hot tier current
                                    module.weight_scale.detach() if blocked else None)
            module.weight = view
            if blocked:
                module.weight_scale = scales
        else:  # copied in place into the table's rows, behind a hot tier's back
            module.table.refresh_hot_rows()
        if hasattr(module, "weight_scale_2"):
            module.set_global_scale(module.weight_scale_2)
        elif hasattr(module, "weight_scale") and not blocked:
            try:
                module.set_scale(module.weight_scale)
            except ValueError:  # keep the buffer equal to the scale the table still uses
                module.weight_scale = torch.tensor(float(module.table.scale))
                raise

    def _apply(self, fn, recurse=True):
        """``.to()``, ``.cuda()``, ``.half()`` leave the rows alone: where the table lives and its
        storage dtype are fixed by ``placement`` and ``weight_dtype`` (overrides torch's hook)."""
        return self


class NGramEmbeddingModule(torch.nn.Module):
    """Dense PLE layer ``layer`` of ``config``: ids of a packed batch, then their table rows.

    ``placement``: ``"gpu"`` (device memory), ``"pinned"`` (host memory the GPU reads) or
    ``"cpu"``. ``weight_dtype``: the table's storage type (float32, float16, bfloat16 or
    float8_e4m3fn, as a torch dtype or a name); by default ``config.ple_embedding_dtype``, else
    torch's default dtype, as the reference layer does. The table is allocated here and filled by
    ``load_weights`` (or ``load_state_dict``); lookups give bfloat16 for float8 and bfloat16
    tables, the storage type otherwise. ``hot_rows`` (sorted unique row ids, e.g. from
    ``ngram-cupy stats --save-hot-rows``; placement ``"pinned"`` or ``"cpu"``) puts those rows
    in a hot tier (GPU memory for a pinned table) that lookups read them from; every load path
    keeps it current, and a caller who changes ``ngram_embedding.weight`` in place calls
    ``refresh_hot_rows()`` afterwards. ``scale_rounding``: how the float8 scale rounds
    (``EmbeddingTable``; default ``"output"``, as vLLM 0.33).
    """

    def __init__(self, config: NGramConfig, layer: int, *, placement: str = "gpu",
                 weight_dtype: torch.dtype | str | None = None, hot_rows=None,
                 scale_rounding: str = "output"):
        super().__init__()
        if not isinstance(config, NGramConfig):
            raise TypeError(f"config must be an NGramConfig, got {type(config).__name__}")
        if config.head_dim is None:
            raise ValueError("config has no embedding_dim (ple_embed_dim): the table size is "
                             "unknown")
        if weight_dtype is None:
            weight_dtype = config.ple_embedding_dtype or torch.get_default_dtype()
        layout = layer_layout(config, layer)
        table = EmbeddingTable.empty(layout.padded_rows, layout.head_dim, weight_dtype,
                                     placement=placement, hot_rows=hot_rows,
                                     scale_rounding=scale_rounding)
        self.layout = layout
        self.embedding = NGramEmbedding(layout, table)
        self.out_dtype = default_output(table.format).torch_dtype
        self.register_buffer("layer_multipliers", torch.tensor(layout.multipliers))
        self.register_buffer("ngram_heads_vocab_sizes", torch.tensor(layout.head_sizes))
        self.register_buffer("ngram_heads_offsets", torch.tensor(layout.head_offsets))
        self.ngram_embedding = TableWeights(table, table.format.torch_dtype)
        self.register_load_state_dict_pre_hook(NGramEmbeddingModule._check_state_dict)
        self._loaded_shards: set[int] = set()
        self._pending: dict[int, dict[str, torch.Tensor]] = {}  # NVFP4 shard halves waiting

    @property
    def table(self) -> EmbeddingTable:
        """The embedding table the rows live in."""
        return self.embedding.table

    @property
    def missing_shards(self) -> list[int]:
        """Indexes of checkpoint shards ``load_weights`` has not received yet."""
        parts = self.layout.config.split_ngram_parts
        return [i for i in range(parts) if i not in self._loaded_shards]

    def refresh_hot_rows(self) -> None:
        """Copy the hot tier's rows again from the table (after an in-place weight change; the
        load paths do this themselves). Nothing without ``hot_rows``."""
        self.table.refresh_hot_rows()

    # ---- lookups ----

    @staticmethod
    def _batch(input_ids, query_start_loc, ngram_context):
        """The batch on the device of ``input_ids``, and the CUDA stream to run on (or None)."""
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

    def forward(self, hidden_states: torch.Tensor, input_ids: torch.Tensor,
                query_start_loc: torch.Tensor, ngram_context: torch.Tensor) -> torch.Tensor:
        """``[T, num_heads * head_dim]`` embeddings of the batch, in ``self.out_dtype``.

        ``hidden_states`` is taken for the reference layer's signature and not read. After
        ``start_prefetch`` this joins the prefetch and gathers again only heads whose ids
        changed, so a stale prefetch costs time, never correctness.
        """
        input_ids, query_start_loc, ngram_context, stream = self._batch(
            input_ids, query_start_loc, ngram_context)
        width = self.layout.num_heads * self.layout.head_dim
        out = torch.empty((input_ids.shape[0], width), dtype=self.out_dtype,
                          device=input_ids.device)
        return self.embedding.forward(input_ids, query_start_loc, ngram_context, out=out,
                                      stream=stream)

    def start_prefetch(self, hidden_states: torch.Tensor, input_ids: torch.Tensor,
                       query_start_loc: torch.Tensor, ngram_context: torch.Tensor) -> None:
        """Start gathering the batch's rows while the preceding decoder layer runs (a side CUDA
        stream, or a worker thread on the CPU); nothing for a table in GPU memory, as in the
        reference layer."""
        if self.table.placement == "gpu":
            return
        input_ids, query_start_loc, ngram_context, stream = self._batch(
            input_ids, query_start_loc, ngram_context)
        self.embedding.start_prefetch(input_ids, query_start_loc, ngram_context, stream=stream)

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
        """A block of table rows must be ``[rows, head_dim]`` of the storage dtype (NVFP4:
        ``[rows, head_dim / 2]`` packed bytes)."""
        shape = (rows, self.table.format.row_width(self.layout.head_dim))
        if tuple(value.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(value.shape)} but must be {shape}")
        if value.dtype != self.ngram_embedding.weight.dtype:
            raise TypeError(f"{name} has dtype {value.dtype} but the table stores "
                            f"{self.ngram_embedding.weight.dtype} (weight_dtype)")

    def _load_shard(self, name: str, index: int, value: torch.Tensor) -> None:
        """Copy checkpoint shard ``index`` into its rows of the table."""
        parts = self.layout.config.split_ngram_parts
        if index >= parts:
            raise ValueError(f"{name}: shard index {index} is at or past "
                             f"split_ngram_parts={parts}")
        start, stop = split_rows(self.layout.padded_rows, parts, index)
        if self.table.format.blocked:  # rows and their block scales are written together
            self._load_block_scaled_shard(name, index, start, stop, value)
            return
        self._check_rows(name, value, stop - start)
        self.table.write_rows(start, value.detach())
        self._loaded_shards.add(index)

    def _load_block_scaled_shard(self, name: str, index: int, start: int, stop: int,
                                 value: torch.Tensor) -> None:
        """Keep one half of an NVFP4 shard (rows or block scales) until the other arrives, then
        write both (one shard held at most while a checkpoint streams by)."""
        pending = self._pending.setdefault(index, {})
        if name.endswith("weight_scale"):
            fmt = self.table.format
            shape = (stop - start, fmt.scale_width(self.layout.head_dim))
            if tuple(value.shape) != shape or value.dtype not in (torch.float8_e4m3fn,
                                                                  torch.uint8):
                raise ValueError(f"{name} must be float8_e4m3fn of shape {shape} (one scale per "
                                 f"{fmt.block} values), got {value.dtype} of shape "
                                 f"{tuple(value.shape)}")
            pending["scales"] = value.detach()
        else:
            self._check_rows(name, value, stop - start)
            pending["rows"] = value.detach()
        if len(pending) == 2:
            self.table.write_rows(start, pending["rows"], pending["scales"])
            del self._pending[index]
            self._loaded_shards.add(index)

    def _load_scale(self, value: torch.Tensor) -> None:
        """The float8 table's scale: one floating value."""
        if not hasattr(self.ngram_embedding, "weight_scale"):
            raise ValueError(f"{SCALE} is given but the table stores "
                             f"{self.ngram_embedding.weight.dtype}, which takes no scale")
        if value.numel() != 1 or not value.dtype.is_floating_point:
            raise ValueError(f"{SCALE} must hold one floating value, got {value.dtype} of shape "
                             f"{tuple(value.shape)}")
        self.ngram_embedding.set_scale(value)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load ``(name, tensor)`` pairs named as in the checkpoint, relative to the layer.

        Hash buffers are checked against the derived layout; each table shard is copied into
        the table as it arrives (no second copy of the table); the float8 scale is taken;
        ``hashstats_*`` and ``token_lookup`` entries are skipped. Returns the names loaded, with
        shards reported as ``ngram_embedding.weight`` (see ``missing_shards``).
        """
        loaded: set[str] = set()
        for name, value in weights:
            if _is_ignored(name):
                continue
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
            if name in BUFFERS:
                self._check_buffer(name, value)
            elif match := _SHARD.fullmatch(name) or (
                    self.table.format.blocked and _SHARD_SCALES.fullmatch(name)):
                self._load_shard(name, int(match.group(1)), value)
                name = WEIGHT if name.endswith("weight") else SCALE
            elif name == GLOBAL_SCALE and self.table.format.blocked:
                if value.numel() != 1 or not value.dtype.is_floating_point:
                    raise ValueError(f"{name} must hold one floating value, got {value.dtype} "
                                     f"of shape {tuple(value.shape)}")
                self.ngram_embedding.set_global_scale(value)
            elif name in (WEIGHT, SCALE) and self.table.format.blocked:
                raise ValueError(f"{name}: an unsharded {self.table.format.name} tensor is "
                                 "refused; load shard_{i}.weight and shard_{i}.weight_scale")
            elif name == SCALE:
                self._load_scale(value)
            elif name == WEIGHT:
                self._check_rows(name, value, self.layout.padded_rows)
                self.table.write_rows(0, value.detach())
                self._loaded_shards.update(range(self.layout.config.split_ngram_parts))
            else:
                raise ValueError(f"unexpected weight {name!r} for an n-gram embedding layer")
            loaded.add(name)
        return loaded

    def _check_state_dict(self, state_dict, prefix, *args) -> None:
        """Before ``load_state_dict`` copies anything, its hash buffers must match the layout."""
        for name in BUFFERS:
            if prefix + name in state_dict:
                self._check_buffer(name, state_dict[prefix + name])
        if prefix + WEIGHT in state_dict:
            self._loaded_shards.update(range(self.layout.config.split_ngram_parts))

    def extra_repr(self) -> str:
        return (f"layer={self.layout.layer}, heads={self.layout.num_heads}, "
                f"head_dim={self.layout.head_dim}, rows={self.layout.padded_rows}, "
                f"weight_dtype={self.ngram_embedding.weight.dtype}, "
                f"placement={self.table.placement!r}")
