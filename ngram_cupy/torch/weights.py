"""``TableWeights``: an ``EmbeddingTable``'s rows (and block scales, scale) as the layer's
torch buffers, sharing the table's memory, and the names they go by in the layer's state."""

from __future__ import annotations

import warnings

import numpy as np
import torch

from ..formats import FORMATS, Format, default_output, output_format
from ..runtime.checks import check_scale
from ..tables.table import EmbeddingTable
from . import ops as torch_ops
from .op_arguments import check_stored_rows

# Value width in bytes -> the NumPy integer type that moves those bits to torch.
_BITS = {1: np.uint8, 2: np.int16, 4: np.int32}


def layer_key(name: str) -> str:
    """The name of one of the table's tensors (``TensorNames``) in the layer's state."""
    return f"ngram_embedding.{name}"


def stored_rows_format(fmt: Format) -> Format | None:
    """The output format a lookup of stored rows gathers in: the format's ``exact_output`` (the
    storage format itself when lookups produce it; bfloat16 for float8 e4m3, so casting back
    restores the stored value). None for formats whose rows vLLM decodes inside the lookup
    (block-scaled ones)."""
    return None if fmt.exact_output is None else FORMATS[fmt.exact_output]


def storage_view(table: EmbeddingTable, dtype: torch.dtype) -> torch.Tensor:
    """A torch tensor sharing the table's rows (host or device memory), typed ``dtype``."""
    rows = table.host_view if table.host_view is not None else table.device_rows
    raw = rows.view(_BITS[dtype.itemsize])
    if isinstance(raw, np.ndarray):
        with warnings.catch_warnings():  # a shared table's rows are read-only, and say so
            warnings.filterwarnings("ignore", "The given NumPy array is not writable")
            return torch.from_numpy(raw).view(dtype)
    return torch.from_dlpack(raw).view(dtype)


def scales_view(table: EmbeddingTable) -> torch.Tensor:
    """A torch tensor sharing a block-scaled table's block scales, of their type."""
    scales = table.host_scales if table.host_scales is not None else table.device_scales
    tensor = torch.from_numpy(scales) if isinstance(scales, np.ndarray) else \
        torch.from_dlpack(scales)
    return tensor.view(getattr(torch, table.format.block_scale.name))


class TableWeights(torch.nn.Module):
    """The tensors the table's format stores, as buffers named as vLLM's layer names them
    (``Format.layer_names``) that share the table's memory, so ``state_dict`` reads and
    ``load_state_dict`` writes the table in place: the rows (``weight``), block scales where the
    format has them (``weight_scale``, sharing the table's) and the table's one float scale
    where it has one (float8: ``weight_scale``; NVFP4: the global ``weight_scale_2``).
    ``handle``: the layer step's, through which ``dequantize`` reaches the table (``ops.py``)."""

    def __init__(self, table: EmbeddingTable, dtype: torch.dtype, handle: int):
        super().__init__()
        self.table = table
        self.handle = handle
        names = table.format.layer_names
        self.register_buffer(names.rows, storage_view(table, dtype))
        if names.block_scales:
            self.register_buffer(names.block_scales, scales_view(table))
        if names.scale:
            self.register_buffer(names.scale, torch.tensor(1.0, dtype=torch.float32))
            table.scale = np.float32(1.0)
        self.register_load_state_dict_post_hook(TableWeights._after_load)
        self.register_state_dict_pre_hook(TableWeights._before_state_dict)

    def set_scale(self, value: torch.Tensor) -> None:
        """Take a one-element floating tensor as the table's one scale (float8's
        ``weight_scale``, NVFP4's global ``weight_scale_2``): finite and positive, as the
        checkpoint loader requires (zero, NaN or a negative scale would corrupt every row)."""
        name = self.table.format.layer_names.scale
        if name is None:
            raise ValueError(f"the table stores {self.table.format.name}, which takes no scale")
        scale = value.detach().to("cpu", torch.float32).reshape(())
        check_scale(layer_key(name), float(scale.item()))
        setattr(self, name, scale)
        self.table.scale = np.float32(scale.item())

    def set_global_scale(self, value: torch.Tensor) -> None:
        """``set_scale`` by NVFP4's name for its one scale (the global ``weight_scale_2``)."""
        self.set_scale(value)

    @staticmethod
    def _before_state_dict(module: TableWeights, prefix: str, keep_vars: bool) -> None:
        """``state_dict`` (and ``save_pretrained``, pickling) reads the buffers, which share the
        table's rows: the updates issued before it land first (``wait_for_updates``)."""
        module.table.wait_for_updates()

    @staticmethod
    def _after_load(module: TableWeights, incompatible_keys) -> None:
        """After ``load_state_dict`` the table holds the rows and scale just loaded, also when
        ``assign=True`` replaced the buffers instead of copying into them."""
        names = module.table.format.layer_names
        view = storage_view(module.table, module.weight.dtype)
        loaded = getattr(module, names.block_scales) if names.block_scales else None
        scales = scales_view(module.table) if names.block_scales else None
        if module.weight.data_ptr() != view.data_ptr() or (
                loaded is not None and loaded.data_ptr() != scales.data_ptr()):
            module.table.write_rows(0, module.weight.detach(),  # keeps a hot tier current
                                    None if loaded is None else loaded.detach())
            trainable = isinstance(module.weight, torch.nn.Parameter)
            module.weight = torch.nn.Parameter(view) if trainable else view
            if names.block_scales:
                setattr(module, names.block_scales, scales)
        else:  # copied in place into the table's rows, behind a hot tier's back
            module.table.refresh_hot_rows()
        if names.scale:
            try:
                module.set_scale(getattr(module, names.scale))
            except ValueError:  # keep the buffer equal to the scale the table still uses
                setattr(module, names.scale, torch.tensor(float(module.table.scale)))
                raise

    def dequantize(self, rows: torch.Tensor, dtype: torch.dtype | str,
                   block_scales: torch.Tensor | None = None) -> torch.Tensor:
        """Stored rows (``[..., k * head_dim]`` of the storage dtype, as ``forward`` returns
        them with ``return_stored_rows=True``) decoded to ``dtype`` exactly as a lookup decodes
        them, bit for bit: the table's format and scale, through the table gather itself. Rows a
        lookup has decoded already (the module's ``out_dtype``) are cast, as vLLM does for
        NVFP4 rows; stored rows of a block-scaled table need their ``block_scales`` (``[...,
        k * head_dim / block]``, as ``weight_scale`` holds them). The call vLLM 0.33's PLE
        layer makes."""
        out_format = output_format(dtype, "dtype")
        fmt, head_dim = self.table.format, self.table.head_dim
        if not isinstance(rows, torch.Tensor):
            raise TypeError(f"rows must be a torch.Tensor, got {type(rows).__name__}")
        decoded = default_output(fmt).torch_dtype
        if rows.dtype != fmt.torch_dtype:
            if rows.dtype == decoded or fmt.blocked and rows.is_floating_point():
                return rows.to(out_format.torch_dtype)
            raise TypeError(f"rows must be the table's stored rows ({fmt.torch_dtype}) or rows "
                            f"its lookups decoded ({decoded}), got {rows.dtype}")
        check_stored_rows(fmt, head_dim, rows, block_scales)
        return torch_ops.decode(self.handle, rows.detach(),
                                None if block_scales is None else block_scales.detach(),
                                out_format.torch_dtype)

    def _apply(self, fn, recurse=True):
        """``.to()``, ``.cuda()``, ``.half()`` leave the rows alone: where the table lives and its
        storage dtype are fixed by ``placement`` and ``weight_dtype`` (overrides torch's hook)."""
        return self
