"""Engram ids of token (or text) files: each row one whole sequence from position 0, written as a
``list<fixed_size_list<fixed_size_list<int32, H>, L>>`` column (``[T, L, H]`` per row), as the
``ngram-cupy ids --scheme engram`` command streams them."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..hashing.engram_layout import EngramLayout, check_engram_layout
from ..ids.engram_ids import compute_engram_ids
from .config_json import config_hash
from .pipeline import open_output, writer_options
from .token_columns import TextError, TokenStep, check_token_type, field_of


def row_positions(offsets: np.ndarray) -> np.ndarray:
    """Each token's position within its row: ``0..len-1`` per row of the token offsets."""
    lengths = np.diff(offsets)
    return np.arange(offsets[-1] - offsets[0], dtype=np.int64) - np.repeat(
        offsets[:-1] - offsets[0], lengths)


class EngramIds:
    """A batch mapper: each batch gains the Engram ids of its token column, every row hashed as
    a fresh sequence (no lookback). ``text`` first encodes a text column into ``column``.
    Feed the batches in reading order: an error names its row among all the rows seen."""

    def __init__(self, layout: EngramLayout, column: str = "tokens",
                 out_column: str = "engram_ids", text: TokenStep | None = None,
                 to_device: Callable | None = None):
        self.layout = check_engram_layout(layout)
        self.column, self.out_column, self.text = column, out_column, text
        self.to_device = to_device
        self.rows_seen = 0  # rows of the batches mapped so far, for error messages

    def id_type(self) -> pa.DataType:
        """``fixed_size_list<fixed_size_list<int32, H>, L>``: one token's ids."""
        layout = self.layout
        return pa.list_(pa.list_(pa.int32(), layout.num_heads), layout.num_layers)

    def output_schema(self, schema: pa.Schema) -> pa.Schema:
        """The input's schema (with the token column from text), the id column and the ids'
        metadata."""
        if self.text is not None:
            schema = self.text.output_schema(schema)
        check_token_type(self.column, field_of(schema, self.column, "token").type)
        if self.out_column in schema.names:
            raise ValueError(f"id column {self.out_column!r} already exists in the input")
        schema = schema.append(pa.field(self.out_column, pa.list_(self.id_type()),
                                        nullable=False))
        return schema.with_metadata({**(schema.metadata or {}), **self.metadata()})

    def check_tokens(self, values: np.ndarray, offsets: np.ndarray, first_row: int) -> None:
        """Every token an id of the tokenizer: a ``TextError`` naming the column, the row (among
        all rows read, the batch's first being ``first_row``) and the token, not a flat index."""
        vocab = self.layout.vocab_size
        outside = np.flatnonzero((values < 0) | (values >= vocab))
        if outside.size:
            at = int(outside[0])
            row = int(np.searchsorted(offsets - offsets[0], at, side="right")) - 1
            raise TextError(f"column {self.column!r}, row {first_row + row} (0-based, in reading "
                            f"order), token {at - int(offsets[row] - offsets[0])}: "
                            f"{int(values[at])} is not an id of the tokenizer "
                            f"(ids 0..{vocab - 1})")

    def metadata(self) -> dict[bytes, bytes]:
        """Schema metadata as the Qwen ids write it, under ``ngram_cupy``: the library version,
        the config's hash and fields, the token column, the id column's Engram layers and the
        token map's tokenizer."""
        from .._version import package_version

        config = self.layout.config
        record = {"version": package_version(), "scheme": "engram",
                  "config_hash": config_hash(config), "config": config.to_hf(),
                  "token_column": self.column,
                  "layers": [{"column": self.out_column,
                              "engram_layer_ids": [int(i) for i in self.layout.layer_ids]}]}
        return {b"ngram_cupy": json.dumps(record, sort_keys=True).encode()}

    def __call__(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        """``batch`` with its rows' ids appended."""
        schema = self.output_schema(batch.schema)
        first_row, self.rows_seen = self.rows_seen, self.rows_seen + batch.num_rows
        if self.text is not None:
            batch = self.text(batch)
        tokens = batch.column(self.column)
        if tokens.null_count:
            raise ValueError(f"token column {self.column!r} has {tokens.null_count} null rows")
        offsets = tokens.offsets.to_numpy().astype(np.int64)
        values = tokens.values.to_numpy()[offsets[0] : offsets[-1]]
        self.check_tokens(values, offsets, first_row)
        starts = offsets - offsets[0]
        args = (values, row_positions(offsets), starts)
        if self.to_device is None:
            ids = compute_engram_ids(self.layout, *args)
        else:
            ids = compute_engram_ids(self.layout, *map(self.to_device, args)).get()
        per_token = pa.FixedSizeListArray.from_arrays(
            pa.FixedSizeListArray.from_arrays(pa.array(ids.reshape(-1)), self.layout.num_heads),
            self.layout.num_layers)
        column = pa.ListArray.from_arrays(pa.array(starts.astype(np.int32)), per_token)
        return pa.RecordBatch.from_arrays([*batch.columns, column], schema=schema)


def write_engram_ids(batches: Iterable[pa.RecordBatch], mapper: EngramIds, path: str,
                     input_schema: pa.Schema, compression: str = "zstd",
                     progress: Callable[[pa.RecordBatch], None] | None = None) -> None:
    """Write every batch with its ids to the Parquet file ``path`` (``progress`` sees each
    written batch)."""
    schema = mapper.output_schema(input_schema)
    with open_output(path) as sink, pq.ParquetWriter(
            sink, schema, **writer_options(schema, input_schema, compression)) as writer:
        for batch in batches:
            mapped = mapper(batch)
            writer.write_batch(mapped)
            if progress is not None:
                progress(mapped)
