"""Loading a torch layer's table: checkpoint shards as they stream by (``load_weights``) and
``load_state_dict``'s checks, for ``NGramEmbeddingModule``. Handed the layer's layout and its
``TableWeights`` (the table, whichever it is now, and its scale), never the module."""

from __future__ import annotations

import re
from collections.abc import Iterable

import numpy as np
import torch

from ..files.checkpoint_names import BUFFERS
from ..formats import FORMATS
from ..hashing.layout import LayerLayout, split_rows
from ..runtime.checks import check_scale
from ..tables.table import EmbeddingTable
from .weights import TableWeights, layer_key

WEIGHT = "ngram_embedding.weight"
_SHARD = re.compile(r"ngram_embedding\.shard_(\d+)\.(\w+)", re.ASCII)
# Every format's scale, by the name the layer gives it (float8: weight_scale; NVFP4: the global
# weight_scale_2).
_SCALES = {f"ngram_embedding.{fmt.layer_names.scale}" for fmt in FORMATS if fmt.scaled}


def _is_ignored(name: str) -> bool:
    """Checkpoint entries the layer never uses: hash statistics and token lookups."""
    leaf = name.rsplit(".", 1)[-1]
    return leaf.startswith("hashstats_") or leaf == "token_lookup"


class WeightLoading:
    """What one layer has loaded of its table, and the checks of what comes in: shards by index
    (a block-scaled shard once its rows and block scales are both in), the scale, and whether
    lookups may run before every shard arrived (``allow_missing``)."""

    def __init__(self, layout: LayerLayout, weights: TableWeights):
        self.layout = layout
        self.weights = weights
        self.loaded_shards: set[int] = set()
        self.scale_loaded = False
        self.allow_missing = False  # True: look rows up before every shard has arrived
        self._pending: dict[int, dict[str, torch.Tensor]] = {}  # block-scaled shard halves

    @property
    def table(self) -> EmbeddingTable:
        """The table the rows load into (the weights': a shared layer's moves once loaded)."""
        return self.weights.table

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
        missing: list[int | str] = [i for i in holding_rows if i not in self.loaded_shards]
        if self.scale_name is not None and not self.scale_loaded:
            missing.append(self.scale_name)
        return missing

    def check_loaded(self) -> None:
        """Refuse lookups of a partly loaded table (rows never loaded, or a float8 table without
        its scale), unless ``allow_missing_weights``; a table never loaded is left alone."""
        if self.allow_missing or not (self.loaded_shards or self.scale_loaded):
            return
        missing = self.missing_shards
        if missing:
            shown = ", ".join(map(str, missing[:20])) + (", ..." if len(missing) > 20 else "")
            raise ValueError(
                f"layer {self.layout.layer} is partly loaded: missing {shown} (missing_shards); "
                "load them, or set allow_missing_weights = True to look up what is there")

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
        if value.dtype != self.weights.weight.dtype:
            raise TypeError(f"{name} has dtype {value.dtype} but the table stores "
                            f"{self.weights.weight.dtype} (weight_dtype)")

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
        self.loaded_shards.add(index)

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
            self.loaded_shards.add(index)

    def _load_scale(self, name: str, value: torch.Tensor) -> None:
        """The table's one scale (``scale_name``): one floating value."""
        if value.numel() != 1 or not value.dtype.is_floating_point:
            raise ValueError(f"{name} must hold one floating value, got {value.dtype} of shape "
                             f"{tuple(value.shape)}")
        self.weights.set_scale(value)
        self.scale_loaded = True

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
                self.loaded_shards.update(range(self.layout.config.split_ngram_parts))
            else:
                raise ValueError(f"unexpected weight {name!r} for an n-gram embedding layer")
            loaded.add(name)
        return loaded

    def check_state_dict(self, state_dict, prefix: str) -> None:
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
            self.loaded_shards.update(range(self.layout.config.split_ngram_parts))
        if self.scale_name is not None and prefix + self.scale_name in state_dict:
            self.scale_loaded = True

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
