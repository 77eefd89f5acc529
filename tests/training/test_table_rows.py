"""Hogwild: two real processes train one shared table (rows and optimizer state in node-wide
segments) on disjoint rows, and give exactly the one-process result."""

from __future__ import annotations

import multiprocessing

import numpy as np
import pytest

import ngram_cupy as nc

pytestmark = pytest.mark.usefixtures("shm_dir")  # conftest: segments in a private folder
SPAWN = multiprocessing.get_context("spawn")
ROWS, DIM = 64, 8


def step_batches(seed: int, low: int, high: int, steps: int = 3) -> list:
    rng = np.random.default_rng(seed)
    return [(rng.integers(low, high, (16, 2)), rng.standard_normal((16, 2, DIM)).astype(np.float32))
            for _ in range(steps)]


def test_two_processes_on_disjoint_rows_equal_one_process():
    import training_worker

    weight = np.random.default_rng(0).standard_normal((ROWS, DIM)).astype(np.float32)
    work = [step_batches(1, 0, ROWS // 2), step_batches(2, ROWS // 2, ROWS)]
    shared = nc.EmbeddingTable(weight, placement="shared")  # held here: the workers attach
    hogwild = nc.RowwiseAdagrad(shared, 0.1)  # its state segment, attached by the workers
    start = SPAWN.Event()
    ready = [SPAWN.Event() for _ in work]
    done = [SPAWN.Event() for _ in work]
    workers = [SPAWN.Process(target=training_worker.train_shared,
                             args=(weight, jobs, up, start, end))
               for jobs, up, end in zip(work, ready, done, strict=True)]
    for worker in workers:
        worker.start()
    # Every process attaches before any steps: the first step flags the rows as written, and a
    # process attaching after it gets the rows' next generation, a fresh copy (docs/training.md).
    for event in ready:
        assert event.wait(120), "a training process did not attach"
    start.set()
    for worker, event in zip(workers, done, strict=True):
        assert event.wait(120), "a training process did not finish"
        worker.join(60)
        assert worker.exitcode == 0
    alone = nc.EmbeddingTable(weight.copy())
    optimizer = nc.RowwiseAdagrad(alone, 0.1)
    for jobs in work:
        for ids, grad in jobs:
            optimizer.step_from_output_grad(ids, grad)
    assert shared.host_view.tobytes() == alone.host_view.tobytes()
    assert hogwild.state["sum"].tobytes() == optimizer.state["sum"].tobytes()
    assert not np.array_equal(alone.host_view, weight)
    hogwild.close()
    shared.close()
