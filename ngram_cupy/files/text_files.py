"""Plain text (one document per line) and JSON Lines files read in record batches, through
PyArrow's own CSV and JSON readers: parsed a block at a time, so memory does not grow with the
file, and decompressed by name (``.gz``, ``.bz2``, ``.zst``, ``.lz4``)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pyarrow as pa

from .token_source import TokenSource, slices

# Bytes a reader parses at once: the longest line (or JSON record) it can take.
BLOCK_BYTES = 16 << 20
# The CSV reader's field separator for plain text: U+001F (unit separator), a control character
# that text does not hold, so that each line is one field, quotes and commas included.
LINE_SEPARATOR = "\x1f"
TEXT_SUFFIXES = (".txt", ".text")
JSON_LINES_SUFFIXES = (".jsonl", ".ndjson", ".json")
COMPRESSED_SUFFIXES = (".gz", ".bz2", ".zst", ".lz4")  # what PyArrow's readers decompress
# PyArrow's words for a parse error, and what they mean in a text or JSON Lines file.
REASONS = (
    ("straddling object", f"a line longer than {BLOCK_BYTES >> 20} MiB, the readers' block"),
    ("Expected 1 columns", "a line holds the control character U+001F (unit separator), "
                           "which the plain text reader splits on"),
    ("unexpected field", f"a record has a field that the first {BLOCK_BYTES >> 20} MiB of "
                         f"records lack (the JSON reader takes its columns from them)"),
)


def text_kind(path: str) -> str | None:
    """``"text"``, ``"jsonl"`` or None (neither), from the file name's suffix (a compression
    suffix aside)."""
    name = path.lower()
    for suffix in COMPRESSED_SUFFIXES:
        name = name.removesuffix(suffix)
    if name.endswith(TEXT_SUFFIXES):
        return "text"
    return "jsonl" if name.endswith(JSON_LINES_SUFFIXES) else None


def named_errors(path: str, open_reader: Callable[[], pa.RecordBatchReader]
                 ) -> Iterator[pa.RecordBatch]:
    """The batches of a fresh reader; its parse errors as ValueErrors naming the file."""
    try:
        yield from open_reader()
    except pa.ArrowInvalid as e:
        raise ValueError(f"{path}: {reason(e)}") from None


def reason(error: pa.ArrowInvalid) -> str:
    """What a reader's parse error means, in one line."""
    message = " ".join(str(error).split())
    return next((words for marker, words in REASONS if marker in message), message)


def first_schema(path: str, open_reader: Callable[[], pa.RecordBatchReader]) -> pa.Schema:
    """The schema a reader takes from its first block (a ValueError naming the file)."""
    try:
        with open_reader() as reader:
            return reader.schema
    except pa.ArrowInvalid as e:
        raise ValueError(f"{path}: {reason(e)}") from None


def source_of(path: str, schema: pa.Schema, open_reader: Callable[[], pa.RecordBatchReader],
              batch_rows: int, text_column: str | None = None) -> TokenSource:
    """A ``TokenSource`` over a reader's batches, sliced to ``batch_rows``; an empty file has
    no rows (PyArrow's readers refuse one)."""
    if os.path.getsize(path) == 0:
        return TokenSource(path, schema, 0, lambda: iter(()), [(path, schema)], text_column)
    return TokenSource(path, schema, None,
                       lambda: slices(named_errors(path, open_reader), batch_rows),
                       [(path, schema)], text_column)


def open_plain_text(path: str, batch_rows: int, text_column: str = "text") -> TokenSource:
    """One document per line, as the string column ``text_column``: every line a row (an empty
    line an empty document), its bytes as they are (``\\r\\n`` ends a line too)."""
    import pyarrow.csv as csv

    schema = pa.schema([(text_column, pa.string())])
    read = csv.ReadOptions(column_names=[text_column], block_size=BLOCK_BYTES)
    parse = csv.ParseOptions(delimiter=LINE_SEPARATOR, quote_char=False, double_quote=False,
                             escape_char=False, newlines_in_values=False,
                             ignore_empty_lines=False)
    # UTF-8 is checked by the text step, which names the row; no line is ever null
    convert = csv.ConvertOptions(column_types=schema, check_utf8=False, null_values=[],
                                 strings_can_be_null=False, quoted_strings_can_be_null=False)

    def open_reader() -> pa.RecordBatchReader:
        return csv.open_csv(path, read_options=read, parse_options=parse,
                            convert_options=convert)

    return source_of(path, schema, open_reader, batch_rows, text_column)


def open_json_lines(path: str, batch_rows: int, text_column: str | None = None) -> TokenSource:
    """One JSON object per line, its fields the columns in their order, their types inferred
    from the first block (JSON strings stay strings); an empty file has just ``text_column``."""
    import pyarrow.json as json

    read = json.ReadOptions(block_size=BLOCK_BYTES)

    def open_reader() -> pa.RecordBatchReader:
        return json.open_json(path, read_options=read)

    if os.path.getsize(path) == 0:
        schema = pa.schema([] if text_column is None else [(text_column, pa.string())])
        return source_of(path, schema, open_reader, batch_rows)
    return source_of(path, first_schema(path, open_reader), open_reader, batch_rows)
