"""Build data/stdlib_docstrings.parquet: CPython's standard-library docstrings, byte-tokenized.

One document per top-level module of the running interpreter's standard library (``Lib/*.py``):
its module, class and function docstrings read with ``ast`` (nothing is imported), joined by blank
lines. Tokens are the UTF-8 bytes (ids 0-255) followed by one EOS token; documents longer than
``--row-tokens`` are split into consecutive rows that share a ``doc_id``. Usage:

    python data/make_corpus.py [--output data/stdlib_docstrings.parquet]
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent


def module_docstrings(path: Path) -> str:
    """Every distinct docstring of one module, in ``ast.walk`` order, separated by blank lines."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    docs = (
        ast.get_docstring(node)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
    )
    return "\n\n".join(dict.fromkeys(doc for doc in docs if doc))


def build_table(stdlib: Path, eos: int, row_tokens: int) -> pa.Table:
    """Rows of at most ``row_tokens`` byte tokens; each document ends with ``eos``."""
    doc_ids, sources, chunks, rows = [], [], [], []
    texts = ((path, module_docstrings(path)) for path in sorted(stdlib.glob("*.py")))
    for doc_id, (path, text) in enumerate((path, text) for path, text in texts if text):
        tokens = np.append(np.frombuffer(text.encode("utf-8"), dtype=np.uint8), eos)
        for chunk, first in enumerate(range(0, tokens.size, row_tokens)):
            doc_ids.append(doc_id)
            sources.append(f"Lib/{path.name}")
            chunks.append(chunk)
            rows.append(tokens[first : first + row_tokens].astype(np.int32))
    offsets = np.concatenate([[0], np.cumsum([row.size for row in rows])]).astype(np.int32)
    return pa.table({
        "doc_id": pa.array(doc_ids, pa.int32()),
        "source": pa.array(sources, pa.string()),
        "chunk": pa.array(chunks, pa.int32()),
        "tokens": pa.ListArray.from_arrays(offsets, np.concatenate(rows)),
    })


def main() -> int:
    """Write the corpus Parquet file atomically."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default=str(HERE / "stdlib_docstrings.parquet"))
    parser.add_argument("--row-tokens", type=int, default=2048)
    parser.add_argument("--row-group-rows", type=int, default=128)
    args = parser.parse_args()
    eos = json.loads((HERE / "config.json").read_text())["eos_token_id"]
    table = build_table(Path(sysconfig.get_paths()["stdlib"]), eos, args.row_tokens)
    table = table.replace_schema_metadata({
        "source": f"CPython {sys.version.split()[0]} standard library docstrings (PSF License)",
        "tokenizer": f"UTF-8 bytes (token id = byte value 0-255), then eos_token_id={eos}",
    })
    tmp = f"{args.output}.tmp"
    pq.write_table(table, tmp, row_group_size=args.row_group_rows, compression="zstd")
    os.replace(tmp, args.output)
    print(f"wrote {args.output}: {table.num_rows} rows, {table['doc_id'][-1].as_py() + 1} "
          f"documents, {len(table['tokens'].combine_chunks().values)} tokens, "
          f"{os.path.getsize(args.output) / 1e6:.2f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
