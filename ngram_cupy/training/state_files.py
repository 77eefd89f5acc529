"""A trained table's rows and its optimizer's state in one safetensors file, written atomically,
so that a resumed run continues with the same bits; and the states saved by N row-sharded ranks
loaded into M: each new rank reads its rows ``split_rows(total_rows, M, rank)`` and their
optimizer state from the saved files that hold them (only those rows are read)."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import pairwise

import numpy as np

from ..runtime.atomic import atomic_file
from ..runtime.checks import check_integer
from ..runtime.row_split import split_rows
from .table_rows import on_host, restore_rows

ROWS = "rows"
FORMAT = "ngram_cupy.training/1"
SHARD = "shard"  # the metadata key of a saved state's row range and table layout


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
    if os.path.isdir(path):
        raise IsADirectoryError(f"{os.fspath(path)} is a folder, not a training state file: pass "
                                "the files save_training_state wrote (each rank's)")
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
    rank's rows and state are read from the files holding them (``load_resharded``)."""
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
        shard = read_shard(os.fspath(path), metadata)
        header = shard.header
        check_same_rows(path, shard, optimizer.table)
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


def shard_metadata(table) -> str:
    """The row range this table holds of how many rows, as ``save_training_state`` records it."""
    return json.dumps({"row_start": table.row_start, "row_stop": table.row_start + table.num_rows,
                       "total_rows": table.total_rows})


@dataclass(frozen=True)
class SavedShard:
    """One saved training state's layout, read from its metadata alone."""

    path: str
    row_start: int
    row_stop: int
    total_rows: int
    head_dim: int
    dtype: str
    header: dict  # optimizer, steps, shape, settings


def read_shard(path: str, metadata: dict) -> SavedShard:
    """The layout of the state at ``path`` (a file saved without a row range holds a whole
    table); a ValueError naming the file when its metadata is broken (not JSON, a key missing,
    a value of another type)."""
    try:
        header = json.loads(metadata["header"])
        rows, head_dim = header["shape"]
        shard = json.loads(metadata.get(SHARD, "null")) or {"row_start": 0, "row_stop": rows,
                                                            "total_rows": rows}
        numbers = [shard["row_start"], shard["row_stop"], shard["total_rows"], rows, head_dim]
    except (KeyError, TypeError, ValueError) as error:  # JSONDecodeError is a ValueError
        raise ValueError(f"{path} is not a readable training state file: broken metadata "
                         f"({type(error).__name__}: {error})") from error
    if not all(type(number) is int and number >= 0 for number in numbers):
        raise ValueError(f"{path} is not a readable training state file: broken metadata (row "
                         f"range, total rows and shape must be whole numbers, got {shard} and "
                         f"{[rows, head_dim]})")
    return SavedShard(path, *numbers[:3], head_dim, metadata.get("table_dtype"), header)


def check_rank(table, rank, world_size) -> None:
    """``rank`` of ``world_size`` must own exactly the table's rows (``split_rows``)."""
    world_size = check_integer("world_size", world_size, 1)
    rank = check_integer("rank", rank, 0)
    if rank >= world_size:
        raise ValueError(f"rank must lie in [0, world_size={world_size}), got {rank}")
    want = split_rows(table.total_rows, world_size, rank)
    have = (table.row_start, table.row_start + table.num_rows)
    if want != have:
        raise ValueError(f"rank {rank} of {world_size} owns rows [{want[0]}, {want[1]}) of "
                         f"{table.total_rows}, the optimizer's table holds [{have[0]}, "
                         f"{have[1]}): load it with load_ngram_embedding(..., rank={rank}, "
                         f"world_size={world_size})")


def check_layout(shards: list[SavedShard], optimizer) -> list[SavedShard]:
    """The shards sorted by row; a ValueError unless they come from one table of the
    optimizer's layout (total rows, head_dim, dtype, optimizer, steps, settings), overlap
    nowhere and hold every row of this table."""
    table = optimizer.table
    want = {"total rows": table.total_rows, "head_dim": table.head_dim,
            "dtype": table.format.name, "optimizer": optimizer.name}
    for shard in shards:
        got = {"total rows": shard.total_rows, "head_dim": shard.head_dim,
               "dtype": shard.dtype, "optimizer": shard.header.get("optimizer")}
        for key, value in want.items():
            if got[key] != value:
                raise ValueError(f"{shard.path} was saved from a table with {key} {got[key]!r}, "
                                 f"this one has {value!r}")
    for key in ("steps", "settings"):
        values = {json.dumps(shard.header.get(key), sort_keys=True) for shard in shards}
        if len(values) > 1:
            raise ValueError(f"the saved shards have different {key} ({', '.join(sorted(values))}"
                             f"): not one training state")
    ordered = sorted(shards, key=lambda shard: shard.row_start)
    for before, after in pairwise(ordered):
        if after.row_start < before.row_stop:
            raise ValueError(f"the saved shards overlap at row {after.row_start} ({before.path} "
                             f"and {after.path}): pass each rank's file once")
    start, stop = table.row_start, table.row_start + table.num_rows
    covered = start  # this table's rows found so far, in order
    for shard in ordered:
        if shard.row_start > covered:
            break
        covered = max(covered, shard.row_stop)
    if covered < stop:
        following = [shard.row_start for shard in ordered if shard.row_start > covered]
        gap_end = min([stop, *following])
        raise ValueError(f"rows [{covered}, {gap_end}) of this table are in none of the saved "
                         f"files: pass every rank's file")
    return ordered


def gather_rows(shards: list[SavedShard], name: str, start: int, stop: int,
                like: np.ndarray) -> np.ndarray:
    """Rows ``[start, stop)`` of tensor ``name`` across the shards, read slice by slice."""
    out = np.empty((stop - start, *like.shape[1:]), like.dtype)
    for shard in shards:
        low, high = max(start, shard.row_start), min(stop, shard.row_stop)
        if low >= high:
            continue
        with open_state_file(shard.path) as file:
            part = file.get_slice(name)[low - shard.row_start : high - shard.row_start]
        if part.shape[1:] != out.shape[1:]:
            raise ValueError(f"{shard.path} holds {name} of shape {list(part.shape)} per row "
                             f"range, this optimizer {list(like.shape)}")
        out[low - start : high - start] = part.view(out.dtype)
    return out


def load_resharded(paths: Sequence[str | os.PathLike], optimizer, rank=None,
                   world_size=None) -> None:
    """Restore this rank's rows and optimizer state from the files every rank saved (any rank
    count); a ValueError before anything changes for files of another table layout, shards
    that do not tile the rows, or a ``rank`` / ``world_size`` that does not own the table's
    rows."""
    table = optimizer.table
    if (rank is None) != (world_size is None):
        raise ValueError("pass rank and world_size together")
    if rank is not None:
        check_rank(table, rank, world_size)
    shards = []
    for path in map(os.fspath, paths):
        with open_state_file(path) as file:
            metadata = file.metadata() or {}
        if metadata.get("format") != FORMAT:
            raise ValueError(f"{path} is not a training state file of ngram_cupy")
        shards.append(read_shard(path, metadata))
    if not shards:
        raise ValueError("no training state files given")
    shards = check_layout(shards, optimizer)
    start, stop = table.row_start, table.row_start + table.num_rows
    rows = gather_rows(shards, ROWS, start, stop, optimizer.rows)
    state = dict(shards[0].header, shape=[table.num_rows, table.head_dim],
                 state={key: gather_rows(shards, f"state.{key}", start, stop, array)
                        for key, array in optimizer.state.items()})
    optimizer.load_state_dict(state)  # checks the settings and shapes before anything changes
    restore_rows(optimizer, rows)
