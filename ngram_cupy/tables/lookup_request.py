"""One checked lookup of a table: what ``EmbeddingTable.lookup`` and ``prefetch`` pass along."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..formats import Format
from ..runtime.backends import Backend, Call


@dataclass
class LookupRequest:
    """A checked lookup: the bound call, contiguous ids, the output format and destination."""

    call: Call
    ids: Any
    out_format: Format
    shape: tuple[int, int]
    out: Any  # the caller's out viewed as the output format's array type, or None

    @property
    def side(self) -> Backend:
        return self.call.side
