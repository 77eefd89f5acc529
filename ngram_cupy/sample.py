"""Where the sample data lives: ``data/`` of a source checkout (the released model's PLE config
and a corpus of CPython's standard library as text and Qwen3.5 tokens), for examples and docs."""

from __future__ import annotations

import os
from pathlib import Path

DATA_ENV = "NGRAM_CUPY_DATA_DIR"
SAMPLE_FILES = ("config.json", "python_stdlib.parquet")


def data_folder() -> Path:
    """``$NGRAM_CUPY_DATA_DIR`` if set, else the ``data/`` folder beside the package of a source
    checkout (an editable install); a ``FileNotFoundError`` naming both when it lacks the files.

    Returns:
        The folder holding ``config.json`` and ``python_stdlib.parquet``.
    """
    folder = Path(os.environ.get(DATA_ENV) or Path(__file__).resolve().parents[1] / "data")
    missing = [name for name in SAMPLE_FILES if not (folder / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"the sample data ({', '.join(missing)}) is not in {folder}: it ships with a source "
            f"checkout (git clone, then pip install -e .); elsewhere set {DATA_ENV} to its data/")
    return folder
