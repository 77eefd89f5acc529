"""A trained table's rows and its optimizer's state in one safetensors file, written atomically,
so that a resumed run continues with the same bits."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Sequence

import numpy as np

from ..runtime.atomic import atomic_file
from .reshard import SHARD, load_resharded, read_shard, shard_metadata
from .table_rows import on_host, restore_rows

ROWS = "rows"
FORMAT = "ngram_cupy.training/1"


def save_training_state(path: str | os.PathLike, optimizer) -> str:
    """Write the optimizer's table rows (their stored bits), state arrays, step count and
    settings to ``path`` (one safetensors file, replaced in one rename); return the path."""
    from safetensors.numpy import save_file

    state = optimizer.state_dict()
    tensors = {ROWS: np.ascontiguousarray(on_host(optimizer.rows))}
    tensors.update({f"state.{key}": np.ascontiguousarray(value)
                    for key, value in state["state"].items()})
    metadata = {"format": FORMAT, "table_dtype": optimizer.table.format.name,
                "header": json.dumps({key: state[key] for key in
                                      ("optimizer", "steps", "shape", "settings")}),
                SHARD: shard_metadata(optimizer.table)}
    with atomic_file(path) as temporary:
        save_file(tensors, temporary, metadata=metadata)
    return os.fspath(path)


@contextlib.contextmanager
def open_state_file(path: str | os.PathLike) -> Iterator:
    """``safe_open`` of ``path``: a missing file is a FileNotFoundError and a truncated or
    corrupted file (or metadata) a ValueError naming the path, with the safetensors or JSON
    error as its cause."""
    from safetensors import SafetensorError, safe_open

    if not os.path.exists(path):
        raise FileNotFoundError(f"training state file not found: {os.fspath(path)}")
    try:
        with safe_open(os.fspath(path), "np") as file:
            yield file
    except (SafetensorError, json.JSONDecodeError, KeyError) as e:
        raise ValueError(f"{path} is not a readable training state file (truncated or "
                         f"corrupted?): {e}") from e


def load_training_state(path: str | os.PathLike | Sequence[str | os.PathLike], optimizer, *,
                        rank: int | None = None, world_size: int | None = None) -> None:
    """Restore rows and state saved by ``save_training_state`` into ``optimizer`` and its table;
    a ValueError (nothing changed) for a file of another optimizer, dtype, table shape or
    shard (its row range and total rows, recorded when saved, must be the table's).

    Resharding: ``path`` may list the files every rank saved (any rank count), and ``rank`` /
    ``world_size`` (as ``load_ngram_embedding`` takes them) then name the table's rows; this
    rank's rows and state are read from the files holding them (``reshard``)."""
    if not isinstance(path, (str, os.PathLike)) or rank is not None or world_size is not None:
        paths = [path] if isinstance(path, (str, os.PathLike)) else list(path)
        load_resharded(paths, optimizer, rank, world_size)
        return
    with open_state_file(path) as file:
        metadata = file.metadata() or {}
        if metadata.get("format") != FORMAT:
            raise ValueError(f"{path} is not a training state file of ngram_cupy")
        if metadata.get("table_dtype") != optimizer.table.format.name:
            raise ValueError(f"{path} holds a {metadata.get('table_dtype')} table, this one is "
                             f"{optimizer.table.format.name}")
        header = json.loads(metadata["header"])
        check_same_rows(path, read_shard(os.fspath(path), metadata), optimizer.table)
        rows = file.get_tensor(ROWS)
        state = dict(header, state={key.removeprefix("state."): file.get_tensor(key)
                                    for key in file.keys() if key.startswith("state.")})
    if rows.shape != optimizer.rows.shape:
        raise ValueError(f"{path} holds rows of shape {list(rows.shape)}, the table "
                         f"{list(optimizer.rows.shape)}")
    optimizer.load_state_dict(state)  # checks the state before anything changes
    restore_rows(optimizer, rows)


def check_same_rows(path, shard, table) -> None:
    """A ValueError unless the saved state holds the table's rows of the same whole table."""
    saved = (shard.row_start, shard.row_stop, shard.total_rows)
    here = (table.row_start, table.row_start + table.num_rows, table.total_rows)
    if saved != here:
        raise ValueError(f"{path} holds rows [{saved[0]}, {saved[1]}) of {saved[2]}, the "
                         f"optimizer's table [{here[0]}, {here[1]}) of {here[2]}: another "
                         "shard's file (pass every rank's files with rank= and world_size= to "
                         "reshard)")
