"""Asynchronous row updates (``asynchronous=True``): a lookup or prefetch issued after a step
sees its rows bit for bit as the synchronous optimizer leaves them, while the update is still
pending; worker errors reach the next call and change nothing; synchronize and state_dict wait."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import ml_dtypes
import numpy as np
import pytest
from helpers import gated

import ngram_cupy as nc
from ngram_cupy.training import worker

ROWS, DIM, HEADS = 64, 8, 3
OPTIMIZERS = [(nc.SGD, {"lr": 0.1}), (nc.RowwiseAdagrad, {"lr": 0.1}),
              (nc.Adam, {"lr": 0.01}), (nc.Adam, {"lr": 0.01, "rowwise": True})]
PLACEMENTS = [{"placement": "cpu"}, {"placement": "pinned"}, {"placement": "shared"},
              {"placement": "cpu", "hot_rows": np.arange(0, ROWS, 3)}]


def table_weight_of(dtype=np.float32) -> np.ndarray:
    return np.random.default_rng(0).standard_normal((ROWS, DIM)).astype(dtype)


def step_batches_of(count: int, tokens: int = 20):
    """Ids in a few rows (consecutive batches share most of them) and output gradients."""
    rng = np.random.default_rng(1)
    return [(rng.integers(0, ROWS // 4, (tokens, HEADS)),
             rng.standard_normal((tokens, HEADS * DIM)).astype(np.float32))
            for _ in range(count)]


def slowed(optimizer, seconds: float = 0.005):
    """Make each update wait before it writes, so the next call surely finds it pending."""
    apply = optimizer.apply

    def late(*args) -> None:
        time.sleep(seconds)
        apply(*args)

    optimizer.apply = late
    return optimizer


def train_overlapped(table_options: dict, optimizer_class, options: dict, asynchronous: bool,
          prefetch_first: bool, dtype=np.float32, steps: int = 4):
    """Lookups of each next batch after each step (its prefetch issued before or after the
    step), and the final rows."""
    table = nc.EmbeddingTable(table_weight_of(dtype), **table_options)
    optimizer = optimizer_class(table, **options, asynchronous=asynchronous)
    if asynchronous:
        slowed(optimizer)
    data = step_batches_of(steps + 1)
    seen = []
    for (ids, grad), (following, _) in zip(data, data[1:], strict=False):
        table.lookup(ids)
        if prefetch_first:  # gathered while this step's update may land
            table.prefetch(following)
            optimizer.step_from_output_grad(ids, grad)
        else:  # gathered once this step's update landed
            optimizer.step_from_output_grad(ids, grad)
            table.prefetch(following)
        seen.append(table.lookup(following).copy())
        seen.append(table.lookup(ids).copy())  # a plain lookup of the rows just updated
    optimizer.synchronize()
    rows = table.host_view.copy()
    optimizer.close()  # a shared table's state segment is detached
    table.close()
    return seen, rows


@pytest.mark.parametrize("optimizer_class, options", OPTIMIZERS)
@pytest.mark.parametrize("table_options", PLACEMENTS, ids=["cpu", "pinned", "shared", "hot_rows"])
@pytest.mark.parametrize("prefetch_first", [True, False], ids=["prefetch-step", "step-prefetch"])
def test_overlapped_lookups_match_synchronous_bits(optimizer_class, options, table_options,
                                                   prefetch_first):
    reference, rows = train_overlapped({"placement": "cpu"}, optimizer_class, options, False, False)
    seen, overlapped = train_overlapped(table_options, optimizer_class, options, True,
                                        prefetch_first)
    assert overlapped.tobytes() == rows.tobytes()
    for step, (want, got) in enumerate(zip(reference, seen, strict=True)):
        assert got.tobytes() == want.tobytes(), f"lookup {step} differs"


def test_bfloat16_stochastic_rounding_overlapped_matches():
    options = {"lr": 0.1, "stochastic_rounding": True, "seed": 7}
    dtype = ml_dtypes.bfloat16
    reference, rows = train_overlapped({"placement": "cpu"}, nc.RowwiseAdagrad, options, False,
                                       False, dtype)
    seen, overlapped = train_overlapped({"placement": "cpu"}, nc.RowwiseAdagrad, options, True,
                                        True, dtype)
    assert overlapped.tobytes() == rows.tobytes()
    assert all(a.tobytes() == b.tobytes() for a, b in zip(reference, seen, strict=True))


def test_a_prefetch_before_a_synchronous_step_is_gathered_again():
    table = nc.EmbeddingTable(table_weight_of())
    optimizer = nc.SGD(table, lr=0.5)
    (ids, grad), (following, _) = step_batches_of(2)
    table.prefetch(following)
    optimizer.step_from_output_grad(ids, grad)
    assert table.lookup(following).tobytes() == table.host_view[following].tobytes()


def test_step_returns_before_the_update_and_synchronize_waits():
    table = nc.EmbeddingTable(table_weight_of())
    optimizer = nc.RowwiseAdagrad(table, 0.1, asynchronous=True)
    gate = gated(optimizer)
    before = table.host_view.copy()
    ids, grad = step_batches_of(1)[0]
    optimizer.step_from_output_grad(ids, grad)  # returns with the update held
    held = table.storage.host_view  # the rows themselves (host_view would wait for the update)
    assert optimizer.steps == 0 and held.tobytes() == before.tobytes()
    assert optimizer.worker.busy
    threading.Timer(0.05, gate.set).start()
    optimizer.synchronize()
    assert optimizer.steps == 1 and table.host_view.tobytes() != before.tobytes()
    assert not optimizer.worker.busy
    optimizer.close()


def test_state_dict_and_checkpoints_wait_for_pending_updates(tmp_path):
    table = nc.EmbeddingTable(table_weight_of())
    optimizer = nc.RowwiseAdagrad(table, 0.1, asynchronous=True)
    gate = gated(optimizer)
    data = step_batches_of(3)
    for ids, grad in data[:2]:
        threading.Timer(0.05, gate.set).start()
        optimizer.step_from_output_grad(ids, grad)
        gate.clear()
    threading.Timer(0.05, gate.set).start()
    state = optimizer.state_dict()  # waits for the second update
    assert state["steps"] == 2
    path = nc.save_training_state(tmp_path / "state.safetensors", optimizer)
    resumed = nc.RowwiseAdagrad(nc.EmbeddingTable(np.zeros((ROWS, DIM), np.float32)), 0.1)
    nc.load_training_state(path, resumed)
    synchronous = nc.RowwiseAdagrad(nc.EmbeddingTable(table_weight_of()), 0.1)
    for ids, grad in data[:2]:
        synchronous.step_from_output_grad(ids, grad)
    assert resumed.table.host_view.tobytes() == synchronous.table.host_view.tobytes()
    assert resumed.state["sum"].tobytes() == synchronous.state["sum"].tobytes()


def test_worker_errors_reach_the_next_call_and_change_nothing():
    table = nc.EmbeddingTable(table_weight_of())
    optimizer = slowed(nc.RowwiseAdagrad(table, 0.1, asynchronous=True))
    (ids, grad), (more, more_grad) = step_batches_of(2)
    optimizer.step_from_output_grad(ids, grad)
    optimizer.synchronize()
    after_one = table.host_view.copy()
    state = optimizer.state["sum"].copy()
    bad = grad.copy()
    bad[2, 5] = np.nan
    optimizer.step_from_output_grad(ids, bad)  # refused on the worker
    with pytest.raises(ValueError, match="NaN"):
        table.lookup(ids)  # the next call reports it
    assert table.host_view.tobytes() == after_one.tobytes()
    assert optimizer.state["sum"].tobytes() == state.tobytes() and optimizer.steps == 1
    outside = ids.copy()
    outside[3, 1] = ROWS
    optimizer.step_from_output_grad(outside, grad)
    with pytest.raises(IndexError, match=rf"\] = {ROWS} is outside"):
        optimizer.step_from_output_grad(more, more_grad)  # reported here; this one not issued
    optimizer.synchronize()  # nothing pending, no error left
    assert table.host_view.tobytes() == after_one.tobytes() and optimizer.steps == 1
    optimizer.step_from_output_grad(more, more_grad)  # the optimizer goes on
    bad_rows = nc.SparseRows(np.array([1, 1]), np.ones((2, DIM), np.float32))
    optimizer.step(bad_rows)
    with pytest.raises(ValueError, match="sorted and unique"):
        optimizer.synchronize()
    assert optimizer.steps == 2


def test_shape_errors_stay_immediate_and_default_is_synchronous():
    table = nc.EmbeddingTable(table_weight_of())
    optimizer = nc.SGD(table, lr=0.1, asynchronous=True)
    ids, grad = step_batches_of(1)[0]
    with pytest.raises(ValueError, match="grad_out must have shape"):
        optimizer.step_from_output_grad(ids, grad[:, :DIM])
    assert nc.SGD(table, lr=0.1).worker is None
    with pytest.raises(TypeError, match="asynchronous must be True or False"):
        nc.SGD(table, lr=0.1, asynchronous="yes")


def test_close_waits_and_the_table_stops_waiting_for_it():
    table = nc.EmbeddingTable(table_weight_of())
    optimizer = nc.SGD(table, lr=0.1, asynchronous=True)
    gate = gated(optimizer)
    ids, grad = step_batches_of(1)[0]
    optimizer.step_from_output_grad(ids, grad)
    threading.Timer(0.05, gate.set).start()
    optimizer.close()
    assert optimizer.steps == 1 and table.writers.workers == []
    table.lookup(ids)


def test_the_workqueue_layer_is_refused_clearly(monkeypatch):
    monkeypatch.setattr(worker, "threading_layer", lambda: "workqueue")
    with pytest.raises(ValueError, match="asynchronous=True needs Numba's tbb or omp"):
        nc.SGD(nc.EmbeddingTable(table_weight_of()), lr=0.1, asynchronous=True)


UNCOLLECTED = """
import atexit
atexit.register(print, "saved")  # a user's exit handler, registered before ngram_cupy's
import numpy as np
import ngram_cupy as nc
optimizer = nc.SGD(nc.EmbeddingTable(np.zeros((8, 4), np.float32)), lr=0.1, asynchronous=True)
optimizer.step_from_output_grad(np.array([[1]]), np.full((1, 4), np.nan, np.float32))
print("ended")
"""


def test_a_refused_update_nobody_collected_is_reported_at_exit():
    done = subprocess.run([sys.executable, "-c", UNCOLLECTED], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 1 and done.stdout == "ended\nsaved\n"
    assert "refused and no later call reported it" in done.stderr
    assert "grad_out holds NaN or infinite values" in done.stderr
    optimizer = nc.SGD(nc.EmbeddingTable(table_weight_of()), lr=0.1, asynchronous=True)
    optimizer.step_from_output_grad(*step_batches_of(1)[0])
    optimizer.step_from_output_grad(np.array([[1]]), np.full((1, DIM), np.nan, np.float32))
    with pytest.raises(ValueError, match="NaN"):
        optimizer.synchronize()  # collected: nothing is left to report at exit
    assert not worker.UNREPORTED
