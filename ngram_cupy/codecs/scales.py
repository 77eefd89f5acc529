"""A table's scales as its format takes them: the global scale checked and held as float32,
and a block-scaled format's block scales checked and viewed as their uint8 bits."""

from __future__ import annotations

import numpy as np

from ..formats import Format
from ..runtime.checks import check_scale


def scale_value(scale) -> np.float32 | None:
    """The scale as a float32 scalar (exact for bf16 / f16 / f32 inputs), or None."""
    if scale is None:
        return None
    if hasattr(scale, "reshape"):
        count = scale.numel() if hasattr(scale, "numel") else scale.size
        if count != 1:
            raise ValueError(f"scale must be a single value, got shape {tuple(scale.shape)}")
        scale = scale.reshape(())
    try:
        value = np.float32(float(scale))
    except (TypeError, ValueError):
        raise TypeError(f"scale must be a number, got {type(scale).__name__}") from None
    if not np.isfinite(value):
        raise ValueError(f"scale must be finite, got {value}")
    return value


def table_scale(fmt: Format, scale) -> np.float32 | None:
    """``scale_value`` of a table's scale; block-scaled formats without a global scale (MXFP8)
    refuse one (vLLM's lookup has none: a product would round twice), and the formats a
    checkpoint stores a scale for (float8, NVFP4) take only what their loaders take."""
    if scale is not None and fmt.blocked and not fmt.scaled:
        raise ValueError(f"{fmt.name} tables take no scale (their block scales are the only "
                         f"ones), got scale={scale!r}")
    value = scale_value(scale)
    if value is not None and fmt.scaled:
        check_scale("scale", float(value))
    return value


def block_scale_bits(fmt: Format, scales, torch_format: Format | None, num_rows: int,
                     head_dim: int):
    """A block-scaled format's ``block_scales`` checked (``[num_rows, head_dim / block]``, of the
    block scale type or its uint8 bits) and viewed as uint8; None for other formats, which
    refuse them. ValueErrors name the argument."""
    if not fmt.blocked:
        if scales is not None:
            raise ValueError(f"block_scales are only for block-scaled tables (nvfp4, mxfp8), not "
                             f"{fmt.name}")
        return None
    kind = fmt.block_scale.name
    shape = (num_rows, fmt.scale_width(head_dim))
    if scales is None:
        raise ValueError(f"block_scales are required for {fmt.name} tables: {kind} {shape}, "
                         f"one per {fmt.block} values")
    if tuple(scales.shape) != shape:
        raise ValueError(f"block_scales must have shape {shape} (one per {fmt.block} values), "
                         f"got {tuple(scales.shape)}")
    dtype = torch_format.dtype if torch_format is not None else np.dtype(scales.dtype)
    if dtype != fmt.block_scale and not (dtype.kind in "iu" and dtype.itemsize == 1):
        raise ValueError(f"block_scales must be {kind} or its uint8 bits, got {dtype}")
    return scales.view(np.uint8)
