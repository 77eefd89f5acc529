"""Row-sharded training in 2 real processes (torch.distributed, Gloo): tensor-parallel and
data-parallel RowwiseAdagrad steps give exactly the rows of one process training on the whole
batch (data parallel: the ranks' batches concatenated in rank order)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from gloo_ranks import TIMEOUT_S, init_method, run_ranks

import ngram_cupy as nc

torch = pytest.importorskip("torch")

WORKER = Path(__file__).with_name("dist_train_worker.py")
CONFIG = nc.NGramConfig(vocab_size=50, ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=11,
                        eos_token_id=0, embedding_dim=8, split_ngram_parts=3)
LAYOUT = nc.layer_layout(CONFIG, 0)
STEPS, LR, WORLD = 3, 0.1, 2


def step_inputs(rng) -> dict[str, np.ndarray]:
    """Per step: shared ids and targets (tensor parallel), and each rank's own (data parallel,
    uneven counts, rows of both shards, duplicates across ranks)."""
    inputs = {}
    rows = LAYOUT.padded_rows
    for step in range(STEPS):
        for key, count in ((f"{step}", 9), (f"{step}_0", 7), (f"{step}_1", 4 + step)):
            ids = rng.integers(0, rows, (count, LAYOUT.num_heads))
            ids[0, 0] = ids[-1, -1] = 3  # a row summed twice on every rank
            inputs[f"ids_{key}"] = ids
            inputs[f"target_{key}"] = rng.normal(
                size=(count, LAYOUT.num_heads * LAYOUT.head_dim)).astype(np.float32)
    return inputs


def one_process(checkpoint: Path, inputs, mode: str) -> np.ndarray:
    """The rows trained in this process on the whole batch of every step."""
    embedding = nc.load_ngram_embedding(checkpoint, CONFIG, 0, placement="cpu")
    optimizer = nc.RowwiseAdagrad(embedding.table, lr=LR)
    for step in range(STEPS):
        keys = [f"{step}"] if mode == "tp" else [f"{step}_{rank}" for rank in range(WORLD)]
        ids = np.concatenate([inputs[f"ids_{key}"] for key in keys])
        target = np.concatenate([inputs[f"target_{key}"] for key in keys])
        optimizer.step_from_output_grad(ids, embedding.table.lookup(ids) - target)
    return embedding.table.host_view.copy()


def test_two_ranks_train_as_one_process(tmp_path):
    rng = np.random.default_rng(5)
    weight = rng.normal(size=(LAYOUT.padded_rows, LAYOUT.head_dim)).astype(np.float32)
    checkpoint = tmp_path / "ckpt"
    nc.save_ngram_embedding(checkpoint, LAYOUT, weight)
    inputs = step_inputs(rng)
    np.savez(tmp_path / "inputs.npz", **inputs)
    expect = {mode: one_process(checkpoint, inputs, mode) for mode in ("tp", "dp")}  # and
    # compiles the kernels into Numba's disk cache before the ranks start
    job = dict(config=CONFIG.__dict__, checkpoint=str(checkpoint), world_size=WORLD,
               init_method=init_method(), timeout_s=TIMEOUT_S // 2,
               steps=STEPS, lr=LR)
    (tmp_path / "job.json").write_text(json.dumps(job))
    outs = run_ranks(WORKER, tmp_path, WORLD, OMP_NUM_THREADS="1",
                     NUMBA_NUM_THREADS="1")  # 2 ranks on 2 cores
    for mode in ("tp", "dp"):
        trained = np.concatenate([out[mode] for out in outs])
        assert not np.array_equal(trained, weight)
        np.testing.assert_array_equal(trained.view(np.uint32), expect[mode].view(np.uint32))


@pytest.fixture
def one_rank(tmp_path, monkeypatch):
    """A Gloo group of this process alone, and a float32 embedding over it."""
    import torch.distributed as dist

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    weight = np.random.default_rng(3).normal(size=(LAYOUT.padded_rows, LAYOUT.head_dim))
    nc.save_ngram_embedding(tmp_path / "c.safetensors", LAYOUT, weight.astype(np.float32))
    yield dist, nc.load_ngram_embedding(tmp_path / "c.safetensors", CONFIG, 0, placement="cpu")
    dist.destroy_process_group()


def test_bad_steps_are_refused_and_change_no_row(one_rank):
    dist, embedding = one_rank
    lookup = nc.ShardedLookup(embedding, dp_group=dist.group.WORLD)
    trainer = nc.ShardedOptimizer(lookup, nc.RowwiseAdagrad(embedding.table, lr=LR))
    before = embedding.table.host_view.copy()
    ids = np.arange(8).reshape(2, LAYOUT.num_heads)
    with pytest.raises(ValueError, match="grad_out must hold 8 rows of head_dim=2"):
        trainer.step_from_output_grad(ids, np.zeros((2, 3), np.float32))
    bad = ids.copy()
    bad[1, 2] = LAYOUT.padded_rows  # the lookup's words: the id, its index and flat position
    with pytest.raises(IndexError, match=rf"^ids\[1, 2\] = {LAYOUT.padded_rows} is outside the "
                       rf"table's rows \[0, {LAYOUT.padded_rows}\) \(the first such id, at flat "
                       rf"position 6\)"):
        trainer.step_from_output_grad(bad, np.zeros((2, 8), np.float32))
    with pytest.raises(IndexError, match=r"^ids\[0, 0\] = -1 is outside"):
        trainer.step_from_output_grad(torch.as_tensor(ids - 1), np.zeros((2, 8), np.float32))
    np.testing.assert_array_equal(embedding.table.host_view, before)
    with pytest.raises(TypeError, match="lookup must be a ShardedLookup"):
        nc.ShardedOptimizer(embedding, nc.RowwiseAdagrad(embedding.table, lr=LR))


def test_silent_wrong_an_optimizer_of_another_table_is_refused(one_rank):
    dist, embedding = one_rank
    lookup = nc.ShardedLookup(embedding, dp_group=dist.group.WORLD)
    copy = nc.EmbeddingTable(embedding.table.host_view.copy())  # the steps would miss the shard
    with pytest.raises(ValueError, match="optimizer must be a row optimizer of lookup.table"):
        nc.ShardedOptimizer(lookup, nc.SGD(copy, LR))


@pytest.mark.parametrize("data_parallel", [True, False])
def test_silent_wrong_a_gradient_shaped_for_other_ids_is_refused(one_rank, data_parallel):
    dist, embedding = one_rank
    lookup = nc.ShardedLookup(embedding, dp_group=dist.group.WORLD if data_parallel else None)
    trainer = nc.ShardedOptimizer(lookup, nc.SGD(embedding.table, LR))
    before = embedding.table.host_view.copy()
    ids = np.arange(8).reshape(2, 4)  # 8 ids of head_dim 2: [2, 8] or [2, 4, 2]
    with pytest.raises(ValueError, match=r"shaped \(2, 4, 2\) or \(2, 8\) for ids of shape "
                                         r"\(2, 4\)\), got shape \(4, 4\)"):
        trainer.step_from_output_grad(ids, np.ones((4, 4), np.float32))  # 16 values, misread
    np.testing.assert_array_equal(embedding.table.host_view, before)
    trainer.step_from_output_grad(ids.reshape(-1), np.ones((8, 2), np.float32))  # [N, D]
    assert trainer.optimizer.steps == 1
