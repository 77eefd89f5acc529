"""One checked lookup of a table: what ``EmbeddingTable.lookup`` and ``prefetch`` pass along.

Ids of any leading shape ``[..., H]`` (``compute_ngram_ids``' ``[B, S, H]`` of ``[B, S]``
tokens) are looked up as ``[T, H]`` and the rows returned as ``[..., H * head_dim]``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..formats import Format
from ..runtime.backends import DEVICE, Backend, Call, bind
from ..runtime.checks import INDEX_DTYPES, check_destination
from .storage.base import closed_table_error


@dataclass
class LookupRequest:
    """A checked lookup: the bound call, contiguous ``[T, H]`` ids, the output format and
    destination (``[T, H * head_dim]``), and the ids' leading shape."""

    call: Call
    ids: Any
    out_format: Format
    shape: tuple[int, int]
    out: Any  # the caller's out viewed as the output format's array type, or None
    leading: tuple[int, ...]

    @classmethod
    def checked(cls, table, ids, out, out_dtype, stream) -> LookupRequest:
        """Check and convert one lookup's arguments for ``table``; errors name the argument."""
        if table.closed and not table.storage.cold.serves_after_close:
            raise closed_table_error(table.placement)
        check_destination("out", out)
        call = bind(stream, ids=ids, out=out)
        given = call["ids"]
        if given.ndim < 2:
            raise ValueError(f"ids must be 2-D or more ([..., heads]), got shape "
                             f"{tuple(given.shape)}")
        if np.dtype(given.dtype) not in INDEX_DTYPES:
            raise TypeError(f"ids must be int32 or int64, got {given.dtype}")
        table.check_side(call.side)
        if call.side is DEVICE:  # a bad id an earlier GPU lookup met, once the GPU ran it
            table.bad_ids.poll(table.total_rows, call.stream)
        leading, heads = tuple(given.shape[:-1]), given.shape[-1]
        with call.on():
            ids = call.side.contiguous(given).reshape(math.prod(leading), heads)
        out = call["out"]
        if out is not None and out.ndim != 2 and tuple(out.shape) == (
                *leading, heads * table.head_dim) and out.flags.c_contiguous:
            out = out.reshape(ids.shape[0], heads * table.head_dim)
        out_format, out = table.destination(call.side, ids.shape, out, out_dtype,
                                            call.formats.get("out"))
        shape = (ids.shape[0], ids.shape[1] * table.head_dim)
        return cls(call, ids, out_format, shape, out, leading)

    @property
    def side(self) -> Backend:
        return self.call.side

    def returned(self, rows):
        """What the lookup returns: the caller's ``out``, else ``rows`` (a torch tensor for
        torch ids) shaped ``[..., H * head_dim]`` after the ids' leading shape."""
        result = self.call.result(rows, self.out_format)
        if self.call.given.get("out") is not None or len(self.leading) == 1:
            return result
        return result.reshape(*self.leading, self.shape[1])
