"""N-gram ids for tokenized documents held in Arrow: record batches, tables and dataset scans.

A token column is ``list<int32|int64>`` (or ``large_list``), one row per document or per chunk of
one. The ids come back as a column of ``list<fixed_size_list<int64, H>>`` (``large_list`` for a
``large_list`` input): the input's row offsets are reused as they are and the ids are computed
straight into the one buffer the new column wraps. Rows are fresh sequences unless a document-id
column is named; then consecutive rows of one document, also across batches, continue it, so a
document split into rows gets exactly the ids of the whole document.

Text comes in through a ``text_column`` and a tokenizer (``ngram_cupy.text``): each row's text is
encoded to a ``tokens`` column (``list<int32>``, named by ``column``) that the ids are computed from
and that is kept beside them. ``open_tokens`` streams Parquet files and folders and Arrow IPC files.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .runtime.install_hint import install_hint

try:
    import pyarrow as pa
    import pyarrow.compute as pc
except ImportError:  # as the text extra's hint: say which extra brings it
    raise ModuleNotFoundError("ngram_cupy.arrow needs pyarrow: " + install_hint("arrow")
                              ) from None

from ._version import package_version
from .files.config_json import config_hash as config_hash  # ngram_cupy.arrow.config_hash

# Public here since before they moved down to files/, where the id steps over files share them.
from .files.token_columns import TEXT_TYPES as TEXT_TYPES
from .files.token_columns import TOKEN_TYPES as TOKEN_TYPES
from .files.token_columns import TextError, check_text_type, check_token_type, field_of
from .files.token_files import open_tokens as open_tokens  # ngram_cupy.arrow.open_tokens
from .hashing.layout import LayerLayout
from .ids.ngram_ids import advance_context, compute_ngram_ids
from .text import TextTokenizer, as_tokenizer, check_tokenizer

DEFAULT_OUT_COLUMN = "ngram_ids"
DEVICES = ("cpu", "gpu")
ID_TYPES = {"int64": np.int64, "int32": np.int32}


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
    """Output column names: ``out_column`` for one layout (alone or a list of one, as the CLI
    and Ray name it), ``{out_column}_layer{L}`` for several."""
    base = DEFAULT_OUT_COLUMN if out_column is None else out_column
    layouts = as_layouts(layout)
    if len(layouts) == 1:
        return [base]
    names = [f"{base}_layer{item.layer}" for item in layouts]
    if len(set(names)) != len(names):
        raise ValueError(f"layouts repeat a layer: {names}")
    return names


def ids_metadata(layout: LayerLayout | Sequence[LayerLayout], out_column: str | None = None,
                 column: str = "tokens") -> dict[bytes, bytes]:
    """Schema metadata for a file of ids: under ``ngram_cupy``, JSON naming the library version,
    the config's hash (:func:`config_hash`) and hash parameters, the token column, and each id
    column's PLE layer (and decoder layer, with ``ple_layer_ids``)."""
    layouts = as_layouts(layout)
    config = layouts[0].config
    ids = config.ple_layer_ids
    layers = [{"column": name, "layer": item.layer,
               **({} if ids is None else {"decoder_layer": ids[item.layer]})}
              for name, item in zip(id_column_names(layout, out_column), layouts, strict=True)]
    record = {"version": package_version(), "config_hash": config_hash(config),
              "config": config.to_hf(), "token_column": column, "layers": layers}
    return {b"ngram_cupy": json.dumps(record, sort_keys=True).encode()}


def out_of_vocabulary(tokens: np.ndarray, vocab_size: int) -> int:
    """Tokens outside ``[0, vocab_size)``: hashed as the model hashes them (no error), but worth
    counting, as they usually mean a tokenizer that does not match the config."""
    return int(np.count_nonzero((tokens < 0) | (tokens >= vocab_size)))


def check_input_schema(schema: pa.Schema, column: str = "tokens",
                       doc_id_column: str | None = None) -> pa.DataType:
    """Check that the token (and document-id) columns exist and fit; return the token type."""
    token_type = field_of(schema, column, "token").type
    check_token_type(column, token_type)
    if doc_id_column is not None:
        field_of(schema, doc_id_column, "document-id")
    return token_type


def id_dtype(layout: LayerLayout | Sequence[LayerLayout], id_type: str = "int64") -> np.dtype:
    """The NumPy type of the ids: ``int64``, ``int32``, or ``auto`` (int32 when every row id of
    the layouts fits in it: half the bytes to write)."""
    if id_type == "auto":
        fits = all(item.padded_rows <= np.iinfo(np.int32).max for item in as_layouts(layout))
        return np.dtype(np.int32 if fits else np.int64)
    if id_type not in ID_TYPES:
        raise ValueError(f"id_type must be auto, int32 or int64, got {id_type!r}")
    dtype = np.dtype(ID_TYPES[id_type])
    if any(item.padded_rows > np.iinfo(dtype).max for item in as_layouts(layout)):
        raise ValueError(f"id_type {id_type}: row ids of this layout do not fit")
    return dtype


def output_schema(schema: pa.Schema, layout: LayerLayout | Sequence[LayerLayout],
                  column: str = "tokens", out_column: str | None = None,
                  doc_id_column: str | None = None, id_type: str = "int64") -> pa.Schema:
    """Check an input schema and return it with the id columns appended."""
    layouts = as_layouts(layout)
    token_type = check_input_schema(schema, column, doc_id_column)
    names = id_column_names(layout, out_column)
    clash = [name for name in names if name in schema.names]
    if clash:
        raise ValueError(f"output column {clash[0]!r} already exists in the input")
    list_type = pa.large_list if pa.types.is_large_list(token_type) else pa.list_
    ids = pa.from_numpy_dtype(id_dtype(layouts, id_type))
    column_type = list_type(pa.list_(ids, layouts[0].num_heads))
    for name in names:
        schema = schema.append(pa.field(name, column_type, nullable=False))
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
    """A ``list<fixed_size_list<int, H>>`` over ``ids[T, H]`` and the row offsets, no copies."""
    per_token = pa.FixedSizeListArray.from_arrays(pa.array(ids.reshape(-1)), ids.shape[1])
    list_class = pa.LargeListArray if row_offsets.type == pa.int64() else pa.ListArray
    return list_class.from_arrays(row_offsets, per_token)


def token_list_array(encoded: Sequence[Sequence[int]], tokenizer: str = "tokenizer",
                     first_row: int = 0) -> pa.Array:
    """A ``list<int32>`` array over lists of token ids; a ``TextError`` naming the row and the
    id when one does not fit (a custom tokenizer returning ids past int32)."""
    try:
        return pa.array(encoded, type=pa.list_(pa.int32()))
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError):
        limit = np.iinfo(np.int32)
        for row, ids in enumerate(encoded):
            for token in ids:
                if not isinstance(token, (int, np.integer)) or not \
                        limit.min <= token <= limit.max:
                    raise TextError(f"{tokenizer} returned token id {token!r} for row "
                                    f"{first_row + row} (0-based, in reading order): token ids "
                                    "must be integers that fit in int32") from None
        raise


class TextTokens:
    """A ``map_batches``-style callable: each batch gains a ``list<int32>`` token column encoded
    from its text column by ``tokenizer`` (a ``TextTokenizer`` or a spec such as ``qwen3.5``)."""

    def __init__(self, tokenizer: str | TextTokenizer, text_column: str = "text",
                 column: str = "tokens") -> None:
        self.tokenizer = as_tokenizer(tokenizer)
        self.text_column = text_column
        self.column = column
        self.rows_seen = 0  # rows of the batches this step has tokenized, for error messages

    def output_schema(self, schema: pa.Schema) -> pa.Schema:
        """Check the text column and return ``schema`` with the token column appended."""
        check_text_type(self.text_column, field_of(schema, self.text_column, "text").type)
        if self.column in schema.names:
            raise ValueError(f"token column {self.column!r} already exists in the input")
        return schema.append(pa.field(self.column, pa.list_(pa.int32()), nullable=False))

    def __call__(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        """``batch`` with its texts' tokens appended."""
        schema = self.output_schema(batch.schema)
        texts = batch.column(self.text_column)
        if texts.null_count:
            raise ValueError(f"text column {self.text_column!r} has {texts.null_count} null rows")
        first, self.rows_seen = self.rows_seen, self.rows_seen + batch.num_rows
        try:
            strings = texts.to_pylist()
        except UnicodeDecodeError as e:
            row = next(i for i in range(len(texts)) if not _decodes(texts[i]))
            raise TextError(f"text column {self.text_column!r}, row {first + row} (0-based, "
                             f"in reading order): not valid UTF-8 ({e.reason} at byte {e.start})"
                             ) from None
        tokens = token_list_array(self.tokenizer.encode_batch(strings),
                                  f"tokenizer {self.tokenizer.name}", first)
        return pa.RecordBatch.from_arrays([*batch.columns, tokens], schema=schema)


def _decodes(text: pa.Scalar) -> bool:
    """Whether one string scalar is valid UTF-8."""
    try:
        text.as_py()
    except UnicodeDecodeError:
        return False
    return True


def text_tokens(layout: LayerLayout, column: str, text_column: str | None,
                tokenizer: str | TextTokenizer | None) -> TextTokens | None:
    """The text-to-token step for ``text_column``, checked against the layout's config."""
    if text_column is None and tokenizer is None:
        return None
    if text_column is None or tokenizer is None:
        raise ValueError(f"text needs both text_column and tokenizer, got "
                         f"text_column={text_column!r}, tokenizer={tokenizer!r}")
    step = TextTokens(tokenizer, text_column, column)
    check_tokenizer(layout.config, step.tokenizer)
    return step


class NGramIds:
    """A ``map_batches``-style callable: each record batch or table gains its n-gram id columns.

    Stateful only with ``doc_id_column``: a document continuing across calls continues its ids, so
    feed the batches of a scan in order (``dataset.to_batches()`` keeps the files' order).
    ``reuse_buffers=True`` writes every call's ids into the same memory (no page faults on fresh
    allocations): a returned batch is then valid only until the next call, which suits a writer
    that consumes each batch at once. With ``text_column`` and ``tokenizer``, each row's text is
    first encoded into the token column ``column``, which the output keeps. The ids are int64
    (the library's ids) unless ``id_type`` is ``int32`` or ``auto`` (int32 when every row id
    fits: the CLI's and Ray's default), which halves their bytes. One layout (alone or in a
    list) gives the column ``out_column`` (default ``ngram_ids``), several
    ``{out_column}_layer{L}``.
    """

    def __init__(self, layout: LayerLayout | Sequence[LayerLayout], column: str = "tokens",
                 out_column: str | None = None, doc_id_column: str | None = None,
                 device: str = "cpu", reuse_buffers: bool = False, *,
                 text_column: str | None = None,
                 tokenizer: str | TextTokenizer | None = None,
                 id_type: str = "int64") -> None:
        if device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
        self.layouts = as_layouts(layout)
        self.text = text_tokens(self.layouts[0], column, text_column, tokenizer)
        # one layout, or the list (an iterator of layouts is consumed once, by as_layouts)
        self.layout = layout if isinstance(layout, LayerLayout) else self.layouts
        self.column = column
        self.out_column = out_column
        self.doc_id_column = doc_id_column
        self.device = device
        self.reuse_buffers = reuse_buffers
        self.id_dtype = id_dtype(self.layouts, id_type)
        self.id_type = self.id_dtype.name
        self._buffers = [np.empty(0, dtype=self.id_dtype) for _ in self.layouts]
        self._scratch = np.empty(0, dtype=np.int64)  # int64 ids before narrowing to int32
        self.names = id_column_names(self.layout, out_column)
        self.packer = DocumentPacker(self.layouts[0], column, doc_id_column)

    def output_schema(self, schema: pa.Schema) -> pa.Schema:
        """The schema of the batches this callable returns for input ``schema``."""
        if self.text is not None:
            schema = self.text.output_schema(schema)
        return output_schema(schema, self.layout, self.column, self.out_column,
                             self.doc_id_column, self.id_type)

    def _ids(self, packed: PackedRows) -> list[np.ndarray]:
        """Host ``[T, H]`` ids of a packed batch, one array per layout."""
        shape = (packed.tokens.size, self.layouts[0].num_heads)
        arrays = (packed.tokens, packed.query_start_loc, packed.ngram_context)
        if self.device == "gpu":
            from .runtime.backends import DEVICE

            arrays = tuple(DEVICE.asarray(array) for array in arrays)
        results = []
        for i, layout in enumerate(self.layouts):
            if self.reuse_buffers:
                if self._buffers[i].size < shape[0] * shape[1]:
                    self._buffers[i] = np.empty(shape[0] * shape[1], dtype=self.id_dtype)
                host = self._buffers[i][: shape[0] * shape[1]].reshape(shape)
            else:
                host = np.empty(shape, dtype=self.id_dtype)
            wide = host if host.dtype == np.int64 else self._wide(shape)
            if self.device == "gpu":
                compute_ngram_ids(layout, *arrays).get(out=wide)
            else:
                compute_ngram_ids(layout, *arrays, out=wide)
            if wide is not host:
                np.copyto(host, wide, casting="unsafe")  # every id fits: checked by id_dtype
            results.append(host)
        return results

    def _wide(self, shape: tuple[int, int]) -> np.ndarray:
        """A reused int64 ``[T, H]`` buffer the kernels write before the ids are narrowed."""
        if self._scratch.size < shape[0] * shape[1]:
            self._scratch = np.empty(shape[0] * shape[1], dtype=np.int64)
        return self._scratch[: shape[0] * shape[1]].reshape(shape)

    def map_batch(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        """``batch`` with one id column per layout appended."""
        schema = self.output_schema(batch.schema)
        if self.text is not None:
            batch = self.text(batch)
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
                    device: str = "cpu", text_column: str | None = None,
                    tokenizer: str | TextTokenizer | None = None) -> pa.RecordBatch | pa.Table:
    """``batch`` with n-gram id columns: ``out_column`` (default ``ngram_ids``) for one layout,
    ``{out_column}_layer{L}`` for each of several.

    Rows are fresh sequences; with ``doc_id_column``, consecutive rows of one document continue
    it (within this batch or table; use ``NGramIds`` to continue across calls). With
    ``text_column`` and ``tokenizer`` the tokens are encoded from text first, into ``column``.
    """
    return NGramIds(layout, column, out_column, doc_id_column, device, text_column=text_column,
                    tokenizer=tokenizer)(batch)


def ngram_ids_batches(batches: Iterable[pa.RecordBatch],
                      layout: LayerLayout | Sequence[LayerLayout], column: str = "tokens",
                      out_column: str | None = None, *, doc_id_column: str | None = None,
                      device: str = "cpu", text_column: str | None = None,
                      tokenizer: str | TextTokenizer | None = None) -> Iterator[pa.RecordBatch]:
    """Stream ``batches`` (a dataset scan, a file reader) through ``NGramIds``, in order."""
    mapper = NGramIds(layout, column, out_column, doc_id_column, device, text_column=text_column,
                      tokenizer=tokenizer)
    for batch in batches:
        yield mapper(batch)
