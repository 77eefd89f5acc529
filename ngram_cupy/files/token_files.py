"""Token files read in record batches: a Parquet file or folder, an Arrow IPC file or stream, or
plain text and JSON Lines (``text_files``), and zero-copy slices of their batches that bound
the work of one call."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator

import numpy as np
import pyarrow as pa

from .text_files import open_json_lines, open_plain_text, text_kind
from .token_source import TokenSource, slices


def token_slices(batches: Iterable[pa.RecordBatch], column: str,
                 max_tokens: int) -> Iterator[pa.RecordBatch]:
    """Zero-copy slices of whole rows holding at most ``max_tokens`` tokens of ``column`` (a
    longer row alone): bounds the ids one call computes. Batches without the column (text not
    yet tokenized) pass whole."""
    for batch in batches:
        if batch.num_rows == 0 or batch.schema.get_field_index(column) < 0:
            yield batch
            continue
        offsets = batch.column(column).offsets.to_numpy().astype(np.int64)  # no int32 overflow
        start = 0
        while start < batch.num_rows:
            end = int(np.searchsorted(offsets, offsets[start] + max_tokens, side="right")) - 1
            end = min(max(end, start + 1), batch.num_rows)
            yield batch.slice(start, end - start)
            start = end


def open_tokens(path: str | os.PathLike, batch_rows: int = 256,
                text_column: str | None = None) -> TokenSource:
    """Open a Parquet file or folder, an Arrow IPC file or stream, or a plain text (``.txt``: its
    lines in the string column ``text_column``, default ``text``) or JSON Lines file (``.jsonl``,
    ``.ndjson``, ``.json``) for streaming in batches of at most ``batch_rows`` rows; the kind is
    read from the file's magic bytes, else from its name."""
    import pyarrow.dataset as ds
    import pyarrow.parquet as pq

    path = os.fspath(path)
    if isinstance(batch_rows, bool) or not isinstance(batch_rows, int) or batch_rows < 1:
        raise ValueError(f"batch_rows must be a positive integer, got {batch_rows!r}")
    if not os.path.exists(path):
        raise FileNotFoundError(f"input not found: {path}")
    if not (os.path.isdir(path) or os.path.isfile(path)):
        raise ValueError(f"input is not a regular file or folder (a FIFO or device cannot be "
                         f"read twice): {path}")
    if os.path.isdir(path):
        dataset = ds.dataset(path, format="parquet")
        files = [(f.path, f.physical_schema) for f in dataset.get_fragments()]
        if not files:
            raise ValueError(f"no Parquet files in the input folder {path}")
        try:  # every file's columns, int32 tokens widened where another file has int64
            schema = pa.unify_schemas([s for _, s in files], promote_options="permissive")
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
            schema = dataset.schema  # checking each file's schema names the one that does not fit
        dataset = ds.dataset([f for f, _ in files], schema=schema, format="parquet")
        return TokenSource(path, schema, dataset.count_rows(),
                           lambda: dataset.to_batches(batch_size=batch_rows), files)
    with open(path, "rb") as f:
        magic = f.read(6)
    if magic.startswith(b"PAR1"):
        parquet = pq.ParquetFile(path)
        return TokenSource(path, parquet.schema_arrow, parquet.metadata.num_rows,
                           lambda: parquet.iter_batches(batch_size=batch_rows),
                           [(path, parquet.schema_arrow)])
    if magic == b"ARROW1":
        reader = pa.ipc.open_file(pa.memory_map(path))
        num_rows = sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))
        return TokenSource(
            path, reader.schema, num_rows,
            lambda: slices((reader.get_batch(i) for i in range(reader.num_record_batches)),
                           batch_rows),
            [(path, reader.schema)],
        )
    kind = text_kind(path)
    if kind == "text":
        return open_plain_text(path, batch_rows, text_column or "text")
    if kind == "jsonl":
        return open_json_lines(path, batch_rows, text_column)
    try:
        schema = pa.ipc.open_stream(pa.memory_map(path)).schema
    except pa.ArrowInvalid:
        raise ValueError(f"{path} is neither a Parquet nor an Arrow IPC file, nor plain text "
                         f"(.txt) or JSON Lines (.jsonl)") from None
    return TokenSource(path, schema, None,
                       lambda: slices(pa.ipc.open_stream(pa.memory_map(path)), batch_rows),
                       [(path, schema)])
