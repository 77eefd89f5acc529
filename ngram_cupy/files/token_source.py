"""The record batches of a token file, as a reader hands them out: ``TokenSource`` describes one
opened file or folder, ``slices`` bounds the rows of each batch without copying."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import pyarrow as pa


@dataclass
class TokenSource:
    """A token file or folder (Parquet, Arrow IPC, plain text or JSON Lines) read in record
    batches."""

    path: str
    schema: pa.Schema
    num_rows: int | None  # None for an IPC stream
    batches: Callable[[], Iterator[pa.RecordBatch]]  # fresh iterator of batches of bounded size
    # Every file read and its own schema (a folder's files may differ from one another).
    files: list[tuple[str, pa.Schema]] = field(default_factory=list)
    text_column: str | None = None  # plain text: the column of its lines, to be tokenized


def slices(batches: Iterable[pa.RecordBatch], rows: int) -> Iterator[pa.RecordBatch]:
    """Zero-copy slices of at most ``rows`` rows of each batch."""
    for batch in batches:
        for start in range(0, batch.num_rows, rows):
            yield batch.slice(start, rows)
