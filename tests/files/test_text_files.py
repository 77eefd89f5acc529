"""Plain text and JSON Lines inputs: every line (record) one row, as PyArrow's readers give it,
streamed in batches of the asked size, and errors that name the file."""

from __future__ import annotations

import gzip
import json
import re

import pytest

pa = pytest.importorskip("pyarrow")

from ngram_cupy.files import text_files  # noqa: E402
from ngram_cupy.files.token_files import open_tokens  # noqa: E402

# Quotes, commas, tabs, an empty line, a CRLF line end, a BOM-less UTF-8 line, no final newline.
LINES = ['hello, "world"', "", "a,b;c\t'd'", "  leading and trailing  ", "naïve 日本語",
         '"quoted whole line"', "last"]


def column_values(source, column: str) -> list:
    """Every value of ``column`` over a source's batches, checking each batch's size."""
    values = []
    for batch in source.batches():
        assert 0 < batch.num_rows <= 2 and batch.schema == source.schema
        values += batch.column(column).to_pylist()
    return values


def test_plain_text_lines_are_rows_as_written(tmp_path):
    path = tmp_path / "docs.txt"
    path.write_bytes("\n".join(LINES[:3]).encode() + b"\r\n" + "\n".join(LINES[3:]).encode())
    source = open_tokens(path, batch_rows=2)
    assert source.schema == pa.schema([("text", pa.string())]) and source.text_column == "text"
    assert column_values(source, "text") == LINES
    assert column_values(source, "text") == LINES  # a fresh reader each time
    named = open_tokens(path, batch_rows=2, text_column="body")
    assert named.text_column == "body" and column_values(named, "body") == LINES
    compressed = tmp_path / "docs.txt.gz"
    compressed.write_bytes(gzip.compress(path.read_bytes()))
    assert column_values(open_tokens(compressed, batch_rows=2), "text") == LINES


def test_json_lines_keep_their_fields_in_order(tmp_path):
    records = [{"id": 7, "text": LINES[0], "meta": {"tags": ["a"]}},
               {"id": 8, "text": LINES[1], "meta": {"tags": []}},
               {"id": 9, "text": LINES[2], "meta": {"tags": ["b", "c"]}}]
    path = tmp_path / "docs.jsonl"
    path.write_text(json.dumps(records[0]) + "\n\n" + "\n".join(map(json.dumps, records[1:])))
    source = open_tokens(path, batch_rows=2, text_column="text")
    assert source.schema.names == ["id", "text", "meta"] and source.text_column is None
    assert pa.Table.from_batches(list(source.batches())).to_pylist() == records
    tokens = tmp_path / "tokens.ndjson"
    tokens.write_text('{"tokens": [1, 2, 3]}\n{"tokens": []}\n')
    assert column_values(open_tokens(tokens, batch_rows=2), "tokens") == [[1, 2, 3], []]


def test_empty_files_have_no_rows(tmp_path):
    for name, schema in (("e.txt", pa.schema([("text", pa.string())])),
                         ("e.jsonl", pa.schema([("text", pa.string())]))):
        (tmp_path / name).write_bytes(b"")
        source = open_tokens(tmp_path / name, text_column="text")
        assert source.schema == schema and source.num_rows == 0
        assert list(source.batches()) == []


@pytest.mark.parametrize("name, data, words", [
    ("bad.jsonl", b'{"text": "a"}\n{"text": "b"\n', "JSON parse error"),
    ("list.json", b'[{"text": "a"}]\n', "JSON parse error"),
    ("sep.txt", b"fine\nhas \x1f inside\n", r"the control character U\+001F"),
])
def test_unreadable_files_are_value_errors_naming_them(tmp_path, name, data, words):
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))}: .*{words}"):
        list(open_tokens(path).batches())


def test_a_line_past_the_block_names_the_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(text_files, "BLOCK_BYTES", 1 << 10)
    long = b"x" * 5000
    for name, line in (("long.txt", long), ("long.jsonl", b'{"text": "%s"}' % long)):
        path = tmp_path / name
        path.write_bytes(b"short\n" + line + b"\n" if name.endswith(".txt") else line + b"\n")
        with pytest.raises(ValueError, match=f"^{re.escape(str(path))}: a line longer than"):
            list(open_tokens(path).batches())
