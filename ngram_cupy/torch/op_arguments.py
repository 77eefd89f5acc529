"""Checks of the registered ops' tensor arguments (``ops.py``), run before the op does any
work: a malformed call is a TypeError / ValueError naming the argument, never an IndexError or a
reshape error from inside the op."""

from __future__ import annotations

import torch

from ..codecs.scales import check_stored_block_scales
from ..formats import Format


def _ranks(ndims: tuple[int, ...]) -> str:
    """``(1, 2)`` as ``1-D or 2-D``."""
    return " or ".join(f"{n}-D" for n in ndims)


def check_integers(name: str, tensor: torch.Tensor | None, ndims: tuple[int, ...]) -> None:
    """``tensor`` (None allowed) is an integer tensor of one of ``ndims``' ranks."""
    if tensor is None:
        return
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {tensor.dtype}")
    if tensor.ndim not in ndims:
        raise ValueError(f"{name} must be {_ranks(ndims)}, got shape {tuple(tensor.shape)}")


def check_row_ids(ids: torch.Tensor, heads: int) -> None:
    """``ids`` is ``[T, heads]`` integers, one row id a head (the trainable ops' ids)."""
    check_integers("ids", ids, (2,))
    if ids.shape[1] != heads:
        raise ValueError(f"ids must be [T, {heads}] (one row id a head), got shape "
                         f"{tuple(ids.shape)}")


def check_output_gradient(grad_out: torch.Tensor, ids: torch.Tensor, head_dim: int) -> None:
    """``grad_out`` is a floating ``[T, H * head_dim]`` (or ``[T, H, head_dim]``) gradient of the
    lookup of ``ids`` ``[T, H]``."""
    if not grad_out.dtype.is_floating_point:
        raise TypeError(f"grad_out must be a floating tensor, got {grad_out.dtype}")
    tokens, heads = ids.shape
    if grad_out.ndim == 0 or grad_out.shape[0] != tokens or \
            grad_out.numel() != tokens * heads * head_dim:
        raise ValueError(f"grad_out must be [{tokens}, {heads * head_dim}] (the lookup's output "
                         f"for ids of shape {tuple(ids.shape)}), got shape "
                         f"{tuple(grad_out.shape)}")


def check_weight(weight: torch.Tensor, rows: torch.Tensor) -> None:
    """``weight`` is the layer's trainable rows (their shape and dtype)."""
    if weight.shape != rows.shape or weight.dtype != rows.dtype:
        raise ValueError(f"weight must be the layer's weight ({rows.dtype} "
                         f"{tuple(rows.shape)}), got {weight.dtype} {tuple(weight.shape)}")


def check_stored_rows(fmt: Format, head_dim: int, rows: torch.Tensor,
                      block_scales: torch.Tensor | None) -> None:
    """``rows`` are stored rows of the format (``[..., k * head_dim]`` stored values, NVFP4 two
    a byte) with block scales exactly where the format has them."""
    if rows.dtype != fmt.torch_dtype:
        raise TypeError(f"rows must be the table's stored rows ({fmt.torch_dtype}), got "
                        f"{rows.dtype}")
    width = max(head_dim // fmt.pack, 1)  # stored values a row
    if rows.ndim == 0 or rows.shape[-1] % width:
        raise ValueError(f"rows must have a last dimension of whole rows of head_dim="
                         f"{head_dim} ({width} stored values), got shape {tuple(rows.shape)}")
    check_stored_block_scales(fmt, block_scales)
