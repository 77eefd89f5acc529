"""Block-scaled rows packed with their block scales: one aligned record per row in host memory.

A record is a row's stored bytes, then its block scale bytes, padded to a multiple of
``RECORD_ALIGN`` (16) bytes: NVFP4 at head_dim 160 is 80 + 10 -> 96 bytes (three 32-byte
sectors, 0.6x an fp8 row's 160); MXFP8 at head_dim 256 is 256 + 8 -> 272. For MXFP8, 288 (32-byte
aligned) touches the same number of 64-byte cache lines (5) and 32-byte sectors (9) per row as
272 wherever a record starts, so the extra 16 bytes a row would buy nothing: 272 it is. A gather
then reads one record per row instead of a row and a scale row in two arrays. Checkpoints keep
their separate tensors; host storages build the records as the rows are written, and keep
``host_view`` / ``host_scales`` as strided views into them.
"""

from __future__ import annotations

import numpy as np

from ..formats import Format
from .host_memory import anonymous_memory

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


def record_views(records: np.ndarray, fmt: Format, head_dim: int, width: int | None = None):
    """``(rows, scales)`` views into ``records`` (``packed_rows``)."""
    width = fmt.row_width(head_dim) * fmt.itemsize if width is None else width
    rows = records[:, :width].view(fmt.dtype)
    return rows, records[:, width:width + fmt.scale_width(head_dim)]
