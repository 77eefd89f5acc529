"""A trained table's rows and its optimizer's state in one safetensors file, written atomically,
so that a resumed run continues with the same bits."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator

import numpy as np

from ..runtime.atomic import atomic_file

ROWS = "rows"
FORMAT = "ngram_cupy.training/1"


def save_training_state(path: str | os.PathLike, optimizer) -> str:
    """Write the optimizer's table rows (their stored bits), state arrays, step count and
    settings to ``path`` (one safetensors file, replaced in one rename); return the path."""
    from safetensors.numpy import save_file

    state = optimizer.state_dict()
    tensors = {ROWS: np.ascontiguousarray(optimizer.rows)}
    tensors.update({f"state.{key}": np.ascontiguousarray(value)
                    for key, value in state["state"].items()})
    metadata = {"format": FORMAT, "table_dtype": optimizer.table.format.name,
                "header": json.dumps({key: state[key] for key in
                                      ("optimizer", "steps", "shape", "settings")})}
    with atomic_file(path) as temporary:
        save_file(tensors, temporary, metadata=metadata)
    return os.fspath(path)


@contextlib.contextmanager
def open_state_file(path: str | os.PathLike) -> Iterator:
    """``safe_open`` of ``path``: a truncated or corrupted file (or metadata) is a ValueError
    naming the path, with the safetensors or JSON error as its cause."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(os.fspath(path), "np") as file:
            yield file
    except (SafetensorError, json.JSONDecodeError, KeyError) as e:
        raise ValueError(f"{path} is not a readable training state file (truncated or "
                         f"corrupted?): {e}") from e


def load_training_state(path: str | os.PathLike, optimizer) -> None:
    """Restore rows and state saved by ``save_training_state`` into ``optimizer`` and its table;
    a ValueError (nothing changed) for a file of another optimizer, dtype or table shape."""
    with open_state_file(path) as file:
        metadata = file.metadata() or {}
        if metadata.get("format") != FORMAT:
            raise ValueError(f"{path} is not a training state file of ngram_cupy")
        if metadata.get("table_dtype") != optimizer.table.format.name:
            raise ValueError(f"{path} holds a {metadata.get('table_dtype')} table, this one is "
                             f"{optimizer.table.format.name}")
        header = json.loads(metadata["header"])
        rows = file.get_tensor(ROWS)
        state = dict(header, state={key.removeprefix("state."): file.get_tensor(key)
                                    for key in file.keys() if key.startswith("state.")})
    if rows.shape != optimizer.rows.shape:
        raise ValueError(f"{path} holds rows of shape {list(rows.shape)}, the table "
                         f"{list(optimizer.rows.shape)}")
    optimizer.load_state_dict(state)  # checks the state before anything changes
    optimizer.rows[...] = rows.view(optimizer.rows.dtype)
    optimizer.table.refresh_hot_rows()
