"""Block-scaled rows packed with their block scales: one aligned record per row in memory.

A record is a row's stored bytes, then its block scale bytes, padded to a multiple of
``RECORD_ALIGN`` (16) bytes: NVFP4 at head_dim 160 is 80 + 10 -> 96 bytes (three 32-byte
sectors, 0.6x an fp8 row's 160); MXFP8 at head_dim 256 is 256 + 8 -> 272. For MXFP8, 288 (32-byte
aligned) touches the same number of 64-byte cache lines (5) and 32-byte sectors (9) per row as
272 wherever a record starts, so the extra 16 bytes a row would buy nothing: 272 it is. A gather
then reads one record per row instead of a row and a scale row in two arrays. Checkpoints keep
their separate tensors; storages (host memory, GPU memory, pinned memory the GPU reads, hot
tiers) build the records as the rows are written, and keep ``host_view`` / ``host_scales`` and
``device_view`` / ``device_scales`` as strided views into them: ``kernels/gather.cu`` reads the
views' row strides, the Numba kernels the whole records (``whole_records``).
"""

from __future__ import annotations

import numpy as np

from ..formats import Format
from ..memory.anonymous import anonymous_memory
from ..runtime.backends import cupy_module, data_address

RECORD_ALIGN = 16


def record_bytes(fmt: Format, head_dim: int) -> int:
    """Bytes one row takes in host memory: a block-scaled format's packed record (row bytes
    and block scales, padded to ``RECORD_ALIGN``), else the row's bytes."""
    row = fmt.row_bytes(head_dim)
    return -(-row // RECORD_ALIGN) * RECORD_ALIGN if fmt.blocked else row


def packed_rows(num_rows: int, head_dim: int, fmt: Format):
    """``(records, rows, scales)``: new uint8 ``[num_rows, record_bytes]`` records (huge pages
    where offered, padding zero) and the rows (``fmt.dtype`` ``[num_rows, row_width]``) and
    block scales (uint8 ``[num_rows, scale_width]``) as strided views into them."""
    record = record_bytes(fmt, head_dim)
    width = fmt.row_width(head_dim) * fmt.itemsize
    memory = anonymous_memory(max(num_rows * record, 1))
    records = np.frombuffer(memory, np.uint8)[:num_rows * record].reshape(num_rows, record)
    return records, *record_views(records, fmt, head_dim, width)


def device_packed_rows(num_rows: int, head_dim: int, fmt: Format):
    """``(rows, scales)``: raw rows and block scales as views into new zeroed records in GPU
    memory (CuPy), as ``packed_rows`` makes them in host memory."""
    records = cupy_module().zeros((num_rows, record_bytes(fmt, head_dim)), np.uint8)
    return record_views(records, fmt, head_dim, raw=True)


def record_views(records, fmt: Format, head_dim: int, width: int | None = None,
                 raw: bool = False):
    """``(rows, scales)`` views into ``records`` (``packed_rows``; NumPy or CuPy), the rows of
    ``fmt.dtype`` (``raw``: of ``fmt.raw``, which CuPy knows)."""
    width = fmt.row_width(head_dim) * fmt.itemsize if width is None else width
    rows = records[:, :width].view(fmt.raw if raw else fmt.dtype)
    return rows, records[:, width:width + fmt.scale_width(head_dim)]


def whole_records(rows, scales):
    """For kernels that take C-contiguous arrays only (Numba's: they index by shape, not
    strides): ``(rows, scales, 0)`` when the rows and their block scales (or None) are arrays of
    their own; ``(records, records, column)`` when both are views into packed records (a
    storage's ``host_view`` / ``device_view`` and scales): the whole records as one uint8
    ``[num_rows, record_bytes]`` array (NumPy or CuPy, as ``rows``) and the byte column where
    the scales start in each."""
    width = rows.shape[1] * rows.dtype.itemsize
    stride = rows.strides[0]
    if scales is None or stride == width or rows.shape[0] == 0:
        return rows, scales, 0
    column = data_address(scales) - data_address(rows)
    if scales.strides[0] != stride or not width <= column <= stride - scales.shape[1]:
        raise ValueError(f"rows (strides {rows.strides}) and block scales (strides "
                         f"{scales.strides}) must be arrays of their own or views into one "
                         f"record per row")
    module = np if isinstance(rows, np.ndarray) else cupy_module()
    records = module.lib.stride_tricks.as_strided(rows.view(np.uint8), (rows.shape[0], stride),
                                                  (stride, 1))
    return records, records, column
