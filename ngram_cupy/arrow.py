"""N-gram ids for tokenized documents held in Arrow: record batches, tables and dataset scans.

A token column is ``list<int32|int64>`` (or ``large_list``), one row per document or per chunk of
one. The ids come back as a column of ``list<fixed_size_list<int64, H>>`` (``large_list`` for a
``large_list`` input): the input's row offsets are reused as they are and the ids are computed
straight into the one buffer the new column wraps. Rows are fresh sequences unless a document-id
column is named; then consecutive rows of one document, also across batches, continue it, so a
document split into rows gets exactly the ids of the whole document.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .layout import LayerLayout
from .ngram_ids import advance_context, compute_ngram_ids

DEFAULT_OUT_COLUMN = "ngram_ids"
DEVICES = ("cpu", "gpu")
TOKEN_TYPES = (pa.int32(), pa.int64())


def as_layouts(layout: LayerLayout | Sequence[LayerLayout]) -> list[LayerLayout]:
    """One layout or several of the same model, as a non-empty list."""
    layouts = [layout] if isinstance(layout, LayerLayout) else list(layout) if isinstance(
        layout, Iterable) else []
    if not layouts or not all(isinstance(item, LayerLayout) for item in layouts):
        raise TypeError("layout must be a LayerLayout or a non-empty sequence of them")
    if any(item.config != layouts[0].config for item in layouts):
        raise ValueError("all layouts must come from the same NGramConfig")
    return layouts


def id_column_names(layout: LayerLayout | Sequence[LayerLayout],
                    out_column: str | None = None) -> list[str]:
    """Output column names: ``out_column`` for one layout, ``{out_column}_layer{L}`` for several."""
    base = DEFAULT_OUT_COLUMN if out_column is None else out_column
    if isinstance(layout, LayerLayout):
        return [base]
    names = [f"{base}_layer{item.layer}" for item in as_layouts(layout)]
    if len(set(names)) != len(names):
        raise ValueError(f"layouts repeat a layer: {names}")
    return names


def check_token_type(column: str, arrow_type: pa.DataType) -> None:
    """``column`` must be a list or large list of int32/int64 tokens."""
    if not (pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type)) or (
        arrow_type.value_type not in TOKEN_TYPES
    ):
        raise TypeError(
            f"column {column!r} must be list<int32|int64> or large_list<int32|int64>, "
            f"got {arrow_type}"
        )


def field_of(schema: pa.Schema, column: str, role: str) -> pa.Field:
    """The field named ``column``, or a ValueError saying which columns there are."""
    if schema.get_field_index(column) < 0:
        raise ValueError(f"{role} column {column!r} not found; columns are {schema.names}")
    return schema.field(column)


def check_input_schema(schema: pa.Schema, column: str = "tokens",
                       doc_id_column: str | None = None) -> pa.DataType:
    """Check that the token (and document-id) columns exist and fit; return the token type."""
    token_type = field_of(schema, column, "token").type
    check_token_type(column, token_type)
    if doc_id_column is not None:
        field_of(schema, doc_id_column, "document-id")
    return token_type


def output_schema(schema: pa.Schema, layout: LayerLayout | Sequence[LayerLayout],
                  column: str = "tokens", out_column: str | None = None,
                  doc_id_column: str | None = None) -> pa.Schema:
    """Check an input schema and return it with the id columns appended."""
    layouts = as_layouts(layout)
    token_type = check_input_schema(schema, column, doc_id_column)
    names = id_column_names(layout, out_column)
    clash = [name for name in names if name in schema.names]
    if clash:
        raise ValueError(f"output column {clash[0]!r} already exists in the input")
    list_type = pa.large_list if pa.types.is_large_list(token_type) else pa.list_
    id_type = list_type(pa.list_(pa.int64(), layouts[0].num_heads))
    for name in names:
        schema = schema.append(pa.field(name, id_type, nullable=False))
    return schema


@dataclass
class PackedRows:
    """One batch's token rows as a packed batch of requests (runs of rows of one document)."""

    tokens: np.ndarray  # [T] int32/int64, zero-copy view of the Arrow values
    row_offsets: pa.Array  # [rows + 1], starting at 0: the input's offsets, rebased if sliced
    query_start_loc: np.ndarray  # [R + 1]: token starts of each run of one document's rows
    ngram_context: np.ndarray  # [R, n - 1] int64: all EOS, or the carried context for run 0


class DocumentPacker:
    """Packs token rows into requests, carrying the context of the last document between batches.

    Without a document-id column every row is a fresh sequence. With one, consecutive rows with
    equal ids form one request, and a batch whose first row continues the previous batch's last
    document starts from that document's rolled context.
    """

    def __init__(self, layout: LayerLayout, column: str = "tokens",
                 doc_id_column: str | None = None) -> None:
        self.layout = layout
        self.column = column
        self.doc_id_column = doc_id_column
        self._last_doc: Any = None
        self._last_context: np.ndarray | None = None

    def _tokens(self, batch: pa.RecordBatch) -> tuple[np.ndarray, pa.Array]:
        """Zero-copy token values and row offsets rebased to start at 0."""
        rows = batch.column(self.column)
        if rows.null_count:
            raise ValueError(f"column {self.column!r} has {rows.null_count} null rows")
        values = rows.flatten()  # honours slicing: exactly the rows' tokens
        if values.null_count:
            raise ValueError(f"column {self.column!r} has {values.null_count} null tokens")
        offsets = rows.offsets
        if len(offsets) == 0:  # a zero-length array may have no offsets buffer at all
            offsets = pa.array([0], offsets.type)
        elif offsets[0].as_py() != 0:
            offsets = pc.subtract(offsets, offsets[0])
        return values.to_numpy(zero_copy_only=True), offsets

    def _run_starts(self, batch: pa.RecordBatch) -> np.ndarray:
        """First row of each run of equal document ids (every row without a document-id column)."""
        if self.doc_id_column is None:
            return np.arange(batch.num_rows)
        doc = batch.column(self.doc_id_column)
        if doc.null_count:
            raise ValueError(f"document-id column {self.doc_id_column!r} has null values")
        if batch.num_rows == 0:
            return np.zeros(0, dtype=np.int64)
        try:
            same = pc.equal(doc.slice(1), doc.slice(0, batch.num_rows - 1))
        except pa.ArrowNotImplementedError:
            raise TypeError(
                f"document-id column {self.doc_id_column!r} has a type that cannot be compared: "
                f"{doc.type}"
            ) from None
        changes = np.flatnonzero(~same.to_numpy(zero_copy_only=False)) + 1
        return np.concatenate([[0], changes])

    def pack(self, batch: pa.RecordBatch) -> PackedRows:
        """The packed batch for ``batch``; rolls the carried context past its last document."""
        check_input_schema(batch.schema, self.column, self.doc_id_column)
        tokens, row_offsets = self._tokens(batch)
        run_rows = self._run_starts(batch)
        offsets = row_offsets.to_numpy(zero_copy_only=False)
        starts = np.append(offsets[run_rows], offsets[-1])
        width = self.layout.ngram_size - 1
        context = np.full((run_rows.size, width), self.layout.eos_token_id, dtype=np.int64)
        if run_rows.size and self.doc_id_column is not None:
            doc = batch.column(self.doc_id_column)
            if self._last_context is not None and doc[0].as_py() == self._last_doc:
                context[0] = self._last_context
            last = run_rows.size - 1
            self._last_doc = doc[-1].as_py()
            self._last_context = advance_context(
                self.layout, tokens[starts[last]:], np.array([0, tokens.size - starts[last]]),
                context[last:],
            )[0]
        return PackedRows(tokens, row_offsets, starts, context)


def wrap_ids(ids: np.ndarray, row_offsets: pa.Array) -> pa.Array:
    """A ``list<fixed_size_list<int64, H>>`` over ``ids[T, H]`` and the row offsets, no copies."""
    per_token = pa.FixedSizeListArray.from_arrays(pa.array(ids.reshape(-1)), ids.shape[1])
    list_class = pa.LargeListArray if row_offsets.type == pa.int64() else pa.ListArray
    return list_class.from_arrays(row_offsets, per_token)


class NGramIds:
    """A ``map_batches``-style callable: each record batch or table gains its n-gram id columns.

    Stateful only with ``doc_id_column``: a document continuing across calls continues its ids, so
    feed the batches of a scan in order (``dataset.to_batches()`` keeps the files' order).
    ``reuse_buffers=True`` writes every call's ids into the same memory (no page faults on fresh
    allocations): a returned batch is then valid only until the next call, which suits a writer
    that consumes each batch at once.
    """

    def __init__(self, layout: LayerLayout | Sequence[LayerLayout], column: str = "tokens",
                 out_column: str | None = None, doc_id_column: str | None = None,
                 device: str = "cpu", reuse_buffers: bool = False) -> None:
        if device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
        self.layouts = as_layouts(layout)
        # one layout, or the list (an iterator of layouts is consumed once, by as_layouts)
        self.layout = layout if isinstance(layout, LayerLayout) else self.layouts
        self.column = column
        self.out_column = out_column
        self.doc_id_column = doc_id_column
        self.device = device
        self.reuse_buffers = reuse_buffers
        self._buffers = [np.empty(0, dtype=np.int64) for _ in self.layouts]
        self.names = id_column_names(self.layout, out_column)
        self.packer = DocumentPacker(self.layouts[0], column, doc_id_column)

    def output_schema(self, schema: pa.Schema) -> pa.Schema:
        """The schema of the batches this callable returns for input ``schema``."""
        return output_schema(schema, self.layout, self.column, self.out_column,
                             self.doc_id_column)

    def _ids(self, packed: PackedRows) -> list[np.ndarray]:
        """Host ``[T, H]`` int64 ids of a packed batch, one array per layout."""
        shape = (packed.tokens.size, self.layouts[0].num_heads)
        arrays = (packed.tokens, packed.query_start_loc, packed.ngram_context)
        if self.device == "gpu":
            import cupy

            arrays = tuple(cupy.asarray(array) for array in arrays)
        results = []
        for i, layout in enumerate(self.layouts):
            if self.reuse_buffers:
                if self._buffers[i].size < shape[0] * shape[1]:
                    self._buffers[i] = np.empty(shape[0] * shape[1], dtype=np.int64)
                host = self._buffers[i][: shape[0] * shape[1]].reshape(shape)
            else:
                host = np.empty(shape, dtype=np.int64)
            if self.device == "gpu":
                compute_ngram_ids(layout, *arrays).get(out=host)
            else:
                compute_ngram_ids(layout, *arrays, out=host)
            results.append(host)
        return results

    def map_batch(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        """``batch`` with one id column per layout appended."""
        schema = self.output_schema(batch.schema)
        packed = self.packer.pack(batch)
        columns = [wrap_ids(ids, packed.row_offsets) for ids in self._ids(packed)]
        return pa.RecordBatch.from_arrays([*batch.columns, *columns], schema=schema)

    def __call__(self, data: pa.RecordBatch | pa.Table) -> pa.RecordBatch | pa.Table:
        """Map a record batch, or each record batch of a table (chunked columns), in order."""
        if isinstance(data, pa.RecordBatch):
            return self.map_batch(data)
        if isinstance(data, pa.Table):
            schema = self.output_schema(data.schema)
            return pa.Table.from_batches([self.map_batch(b) for b in data.to_batches()], schema)
        raise TypeError(f"expected a pyarrow RecordBatch or Table, got {type(data).__name__}")


def ngram_ids_batch(batch: pa.RecordBatch | pa.Table,
                    layout: LayerLayout | Sequence[LayerLayout], column: str = "tokens",
                    out_column: str | None = None, *, doc_id_column: str | None = None,
                    device: str = "cpu") -> pa.RecordBatch | pa.Table:
    """``batch`` with n-gram id columns: ``out_column`` (default ``ngram_ids``) for one layout,
    ``{out_column}_layer{L}`` for each of several.

    Rows are fresh sequences; with ``doc_id_column``, consecutive rows of one document continue
    it (within this batch or table; use ``NGramIds`` to continue across calls).
    """
    return NGramIds(layout, column, out_column, doc_id_column, device)(batch)


def ngram_ids_batches(batches: Iterable[pa.RecordBatch],
                      layout: LayerLayout | Sequence[LayerLayout], column: str = "tokens",
                      out_column: str | None = None, *, doc_id_column: str | None = None,
                      device: str = "cpu") -> Iterator[pa.RecordBatch]:
    """Stream ``batches`` (a dataset scan, a file reader) through ``NGramIds``, in order."""
    mapper = NGramIds(layout, column, out_column, doc_id_column, device)
    for batch in batches:
        yield mapper(batch)
