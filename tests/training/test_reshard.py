"""Training states saved by N row-sharded ranks load into M ranks with the same rows and state
bits (ranks simulated in-process: one shard table and optimizer per rank, each stepping on the
terms of its own rows, as tensor-parallel ``ShardedOptimizer`` does)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import ngram_cupy as nc
from ngram_cupy.runtime.row_split import split_rows

TOTAL, DIM = 41, 6
OPTIMIZERS = {"rowwise_adagrad": (nc.RowwiseAdagrad, {"lr": 0.1, "weight_decay": 0.01}),
              "adam": (nc.Adam, {"lr": 0.01})}


def sharded_batch(step):
    rng = np.random.default_rng(300 + step)
    return (rng.integers(0, TOTAL, 96),
            rng.standard_normal((96, DIM)).astype(np.float32))


def shard_optimizers(world_size, name, weight, dtype=np.float32):
    """One (table, optimizer) per rank, holding rows ``split_rows(TOTAL, world_size, rank)``."""
    cls, kwargs = OPTIMIZERS[name]
    ranks = []
    for rank in range(world_size):
        start, stop = split_rows(TOTAL, world_size, rank)
        table = nc.EmbeddingTable(weight[start:stop].astype(dtype), row_start=start,
                                  total_rows=TOTAL)
        ranks.append(cls(table, **kwargs))
    return ranks


def step_all(ranks, steps):
    """Every rank steps on the terms of its own rows, in the batch's order."""
    for step in steps:
        ids, grad = sharded_batch(step)
        for optimizer in ranks:
            table = optimizer.table
            mine = (ids >= table.row_start) & (ids < table.row_start + table.num_rows)
            assert mine.any()
            optimizer.step_from_output_grad(ids[mine], grad[mine])


def whole(ranks):
    """The ranks' rows and state arrays concatenated in row order."""
    rows = np.concatenate([optimizer.rows for optimizer in ranks])
    state = {key: np.concatenate([optimizer.state[key] for optimizer in ranks])
             for key in ranks[0].state}
    return rows, state


def same_state_bits(ranks, others) -> bool:
    """The same rows and state bits, whatever the rank counts."""
    (rows, state), (other_rows, other_state) = whole(ranks), whole(others)
    return rows.tobytes() == other_rows.tobytes() and state.keys() == other_state.keys() \
        and all(state[key].tobytes() == other_state[key].tobytes() for key in state)


def save_all(ranks, folder):
    return [nc.save_training_state(folder / f"rank{rank}.safetensors", optimizer)
            for rank, optimizer in enumerate(ranks)]


@pytest.mark.parametrize(("saved", "loaded", "name"),
                         [(2, 3, "rowwise_adagrad"), (2, 3, "adam"), (3, 1, "rowwise_adagrad"),
                          (1, 4, "adam")])
def test_a_state_from_n_ranks_resumes_on_m_with_the_same_bits(tmp_path, saved, loaded, name):
    weight = np.random.default_rng(1).standard_normal((TOTAL, DIM)).astype(np.float32)
    straight = shard_optimizers(1, name, weight)
    step_all(straight, range(4))
    before = shard_optimizers(saved, name, weight)
    step_all(before, range(2))
    paths = save_all(before, tmp_path)
    after = shard_optimizers(loaded, name, np.zeros_like(weight))
    for rank, optimizer in enumerate(after):
        nc.load_training_state(paths[::-1], optimizer, rank=rank, world_size=loaded)
    assert same_state_bits(after, before)
    assert {optimizer.steps for optimizer in after} == {2}
    step_all(after, (2, 3))
    assert same_state_bits(after, straight)


def test_bfloat16_rows_reshard_bit_for_bit(tmp_path):
    weight = np.random.default_rng(2).standard_normal((TOTAL, DIM)).astype(np.float32)
    before = shard_optimizers(3, "rowwise_adagrad", weight, ml_dtypes.bfloat16)
    step_all(before, range(2))
    paths = save_all(before, tmp_path)
    after = shard_optimizers(2, "rowwise_adagrad", np.zeros_like(weight), ml_dtypes.bfloat16)
    for rank, optimizer in enumerate(after):
        nc.load_training_state(paths, optimizer, rank=rank, world_size=2)
    assert same_state_bits(after, before)


@pytest.fixture
def saved_two(tmp_path):
    weight = np.random.default_rng(3).standard_normal((TOTAL, DIM)).astype(np.float32)
    ranks = shard_optimizers(2, "rowwise_adagrad", weight)
    step_all(ranks, range(1))
    return save_all(ranks, tmp_path)


def test_another_table_layout_is_a_clear_error(saved_two):
    weight = np.zeros((TOTAL, DIM), np.float32)
    cases = [
        (nc.RowwiseAdagrad(nc.EmbeddingTable(np.zeros((TOTAL + 1, DIM), np.float32)), 0.1),
         "total rows 41, this one has 42"),
        (nc.RowwiseAdagrad(nc.EmbeddingTable(np.zeros((TOTAL, DIM + 1), np.float32)), 0.1),
         "head_dim 6, this one has 7"),
        (nc.RowwiseAdagrad(nc.EmbeddingTable(weight.astype(ml_dtypes.bfloat16)), 0.1),
         "dtype 'float32', this one has 'bfloat16'"),
        (nc.SGD(nc.EmbeddingTable(weight.copy()), 0.1),
         "optimizer 'rowwise_adagrad', this one has 'sgd'"),
    ]
    for optimizer, message in cases:
        with pytest.raises(ValueError, match=message):
            nc.load_training_state(saved_two, optimizer, rank=0, world_size=1)
        assert not optimizer.rows.any() and optimizer.steps == 0


def test_shards_must_tile_the_rows_and_the_rank_own_the_table(saved_two):
    optimizer = shard_optimizers(1, "rowwise_adagrad", np.zeros((TOTAL, DIM), np.float32))[0]
    with pytest.raises(ValueError, match=r"rows \[21, 41\) of this table are in none"):
        nc.load_training_state(saved_two[:1], optimizer)
    with pytest.raises(ValueError, match=r"rows \[0, 21\) of this table are in none"):
        nc.load_training_state(saved_two[1:], optimizer)
    with pytest.raises(ValueError, match="overlap at row 0"):
        nc.load_training_state(saved_two + saved_two[:1], optimizer)
    with pytest.raises(ValueError, match=r"rank 1 of 2 owns rows \[21, 41\)"):
        nc.load_training_state(saved_two, optimizer, rank=1, world_size=2)
    with pytest.raises(ValueError, match=r"rank must lie in \[0, world_size=2\)"):
        nc.load_training_state(saved_two, optimizer, rank=2, world_size=2)
    with pytest.raises(ValueError, match="pass rank and world_size together"):
        nc.load_training_state(saved_two, optimizer, rank=0)
    with pytest.raises(TypeError, match="world_size must be an integer"):
        nc.load_training_state(saved_two, optimizer, rank=0, world_size=1.0)
    assert not optimizer.rows.any() and optimizer.steps == 0
    nc.load_training_state(saved_two, optimizer, rank=0, world_size=1)
    assert optimizer.rows.any() and optimizer.steps == 1


def test_shards_of_different_runs_do_not_mix(tmp_path, saved_two):
    weight = np.zeros((TOTAL, DIM), np.float32)
    other = shard_optimizers(2, "rowwise_adagrad", weight)
    step_all(other, range(2))
    later = nc.save_training_state(tmp_path / "later.safetensors", other[1])
    target = shard_optimizers(1, "rowwise_adagrad", weight)[0]
    with pytest.raises(ValueError, match="different steps"):
        nc.load_training_state([saved_two[0], later], target)


def test_a_file_saved_before_row_ranges_holds_a_whole_table(tmp_path):
    from safetensors import safe_open
    from safetensors.numpy import save_file

    weight = np.random.default_rng(4).standard_normal((TOTAL, DIM)).astype(np.float32)
    (whole_table,) = shard_optimizers(1, "rowwise_adagrad", weight)
    step_all([whole_table], range(1))
    path = nc.save_training_state(tmp_path / "new.safetensors", whole_table)
    with safe_open(path, "np") as file:
        metadata = file.metadata()
        tensors = {key: file.get_tensor(key) for key in file.keys()}
    del metadata["shard"]
    save_file(tensors, tmp_path / "old.safetensors", metadata=metadata)
    after = shard_optimizers(2, "rowwise_adagrad", np.zeros_like(weight))
    for rank, optimizer in enumerate(after):
        nc.load_training_state(tmp_path / "old.safetensors", optimizer, rank=rank, world_size=2)
    assert same_state_bits(after, [whole_table])


def test_a_rank_needs_only_the_files_holding_its_rows(saved_two):
    weight = np.zeros((TOTAL, DIM), np.float32)
    (first, second) = shard_optimizers(2, "rowwise_adagrad", weight)
    nc.load_training_state(saved_two[1:], second, rank=1, world_size=2)
    assert second.rows.any() and second.steps == 1
    with pytest.raises(ValueError, match=r"rows \[0, 21\) of this table are in none"):
        nc.load_training_state(saved_two[1:], first, rank=0, world_size=2)


@pytest.mark.parametrize("broken", [
    {"header": "{not json"},
    {"header": "{}"},  # no shape
    {"header": '{"shape": 7}'},
    {"shard": '{"row_start": 0}'},
    {"shard": '{"row_start": "0", "row_stop": 21, "total_rows": 41}'},
    {"shard": "[1, 2]"},
], ids=["bad json", "no shape", "shape not a pair", "no row_stop", "text row", "not a dict"])
def test_broken_metadata_is_a_value_error_naming_the_file(tmp_path, saved_two, broken):
    from safetensors import safe_open
    from safetensors.numpy import save_file

    with safe_open(saved_two[0], "np") as file:
        metadata = dict(file.metadata(), **broken)
        tensors = {key: file.get_tensor(key) for key in file.keys()}
    path = tmp_path / "broken.safetensors"
    save_file(tensors, path, metadata=metadata)
    optimizer = shard_optimizers(1, "rowwise_adagrad", np.zeros((TOTAL, DIM), np.float32))[0]
    for load in (lambda: nc.load_training_state([path, saved_two[1]], optimizer),
                 lambda: nc.load_training_state(path, optimizer)):
        with pytest.raises(ValueError, match=f"{path}.*metadata"):
            load()
    assert not optimizer.rows.any() and optimizer.steps == 0


def test_a_folder_among_the_state_files_is_named(tmp_path, saved_two):
    optimizer = shard_optimizers(1, "rowwise_adagrad", np.zeros((TOTAL, DIM), np.float32))[0]
    for paths in ([saved_two[0], tmp_path], tmp_path):
        with pytest.raises(IsADirectoryError, match=f"{tmp_path} is a folder"):
            nc.load_training_state(paths, optimizer)
