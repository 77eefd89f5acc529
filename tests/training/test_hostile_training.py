"""Training under hostile input (issue 43): empty batches, poisoned step arguments, shards'
rounding and state files, closed tables and shared tables written by training."""

from __future__ import annotations

import threading

import ml_dtypes
import numpy as np
import pytest
from helpers import gated

import ngram_cupy as nc

ROWS, DIM = 40, 8
FLT_MAX = float(np.finfo(np.float32).max)


def hostile_weight(seed=0, rows=ROWS, dim=DIM) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, dim)).astype(np.float32)


def hostile_batch(seed, tokens=24, heads=3, rows=ROWS, low=0):
    rng = np.random.default_rng(100 + seed)
    return (rng.integers(low, rows, (tokens, heads)),
            rng.standard_normal((tokens, heads, DIM)).astype(np.float32))


def snapshot(optimizer) -> tuple:
    """Everything a step may change: rows, state arrays, step count."""
    return (optimizer.table.host_view.tobytes(), optimizer.steps,
            {key: array.tobytes() for key, array in optimizer.state.items()})


# --- empty batches ---------------------------------------------------------------------------


@pytest.mark.parametrize("make", [lambda t: nc.SGD(t, 0.1), lambda t: nc.Adam(t, 0.01)])
def test_an_empty_batch_is_a_step_that_changes_no_row(make):
    table = nc.EmbeddingTable(hostile_weight(1))  # 40 rows: over the counting sort's 8 per id
    optimizer = make(table)
    optimizer.step_from_output_grad(np.zeros((0, 3), np.int64), np.zeros((0, 3 * DIM), np.float32))
    optimizer.step(nc.embedding_backward(np.zeros(0, np.int64), np.zeros((0, DIM), np.float32),
                                         num_rows=ROWS))
    assert table.host_view.tobytes() == hostile_weight(1).tobytes()
    assert optimizer.steps == 2  # counted, as one process stepping on every rank's batch
    grads = nc.embedding_backward(np.zeros((0, 2), np.int32), np.zeros((0, 2, DIM), np.float32),
                                  num_rows=1000)
    assert grads.indices.shape == (0,) and grads.values.shape == (0, DIM)


# --- arguments that would poison rows ----------------------------------------------------------


@pytest.mark.parametrize("make, match", [
    (lambda t: nc.RowwiseAdagrad(t, 0.1, eps=0.0), r"eps must be finite and in \(0.0"),
    (lambda t: nc.Adam(t, 0.1, eps=-1e-8), r"eps must be finite and in \(0.0"),
    (lambda t: nc.SGD(t, 1e39), "lr must be finite in float32"),
    (lambda t: nc.RowwiseAdagrad(t, 0.1, weight_decay=1e39), "weight_decay must be finite in "
                                                             "float32"),
])
def test_settings_that_poison_rows_are_refused(make, match):
    with pytest.raises(ValueError, match=match):
        make(nc.EmbeddingTable(hostile_weight()))


def test_finite_terms_whose_row_sum_overflows_are_refused_before_any_change():
    optimizer = nc.SGD(nc.EmbeddingTable(hostile_weight(2)), 1e-30)
    before = snapshot(optimizer)
    ids = np.array([[3], [5], [3]])
    grad = np.zeros((3, DIM), np.float32)
    grad[[0, 2], 1] = -FLT_MAX  # finite terms, an infinite sum for row 3
    with pytest.raises(ValueError, match="sum past float32's range"):
        optimizer.step_from_output_grad(ids, grad)
    assert snapshot(optimizer) == before
    grad[2, 1] = FLT_MAX  # large terms that cancel: a finite sum steps
    optimizer.step_from_output_grad(ids, grad)
    assert np.isfinite(optimizer.table.host_view).all() and optimizer.steps == 1


def test_a_step_whose_float32_hyper_parameters_overflow_is_refused():
    optimizer = nc.Adam(nc.EmbeddingTable(hostile_weight(3)), lr=1e30, betas=(1 - 2**-52, 0.999))
    before = snapshot(optimizer)
    with pytest.raises(ValueError, match="hyper-parameters overflow float32"):
        optimizer.step_from_output_grad(*hostile_batch(0))
    assert snapshot(optimizer) == before


# --- stochastic rounding of shards -------------------------------------------------------------


def test_stochastic_rounding_of_two_shards_gives_the_bits_of_the_whole_table():
    full = hostile_weight(4).astype(ml_dtypes.bfloat16)
    whole = nc.EmbeddingTable(full.copy())
    shards = [nc.EmbeddingTable(full[start:start + 20].copy(), row_start=start, total_rows=ROWS)
              for start in (0, 20)]
    options = {"stochastic_rounding": True, "seed": 7}
    one = nc.RowwiseAdagrad(whole, 0.01, **options)
    parts = [nc.RowwiseAdagrad(shard, 0.01, **options) for shard in shards]
    for step in range(3):
        ids, grad = hostile_batch(step)
        one.step_from_output_grad(ids, grad)
        for shard, part in zip(shards, parts, strict=True):
            mine = (ids >= shard.row_start) & (ids < shard.row_start + shard.num_rows)
            part.step_from_output_grad(ids[mine], grad[mine])
    joined = np.concatenate([shard.host_view for shard in shards])
    assert joined.view(np.uint16).tobytes() == whole.host_view.view(np.uint16).tobytes()


# --- state dicts and state files ---------------------------------------------------------------


def test_load_state_dict_restores_the_saved_settings():
    saved = nc.Adam(nc.EmbeddingTable(hostile_weight(5)), lr=0.05, betas=(0.8, 0.99), eps=1e-6,
                    stochastic_rounding=True, seed=3)
    saved.step_from_output_grad(*hostile_batch(0))
    resumed = nc.Adam(nc.EmbeddingTable(saved.table.host_view.copy()))  # default settings
    resumed.load_state_dict(saved.state_dict())
    assert resumed.settings() == saved.settings() and resumed.steps == 1
    for optimizer in (saved, resumed):
        optimizer.step_from_output_grad(*hostile_batch(1))
    assert resumed.table.host_view.tobytes() == saved.table.host_view.tobytes()


@pytest.mark.parametrize("spoil, match", [
    (lambda s: s.pop("steps"), "steps"),
    (lambda s: s.update(steps=-1), "steps"),
    (lambda s: s["settings"].pop("lr"), "settings"),
    (lambda s: s["settings"].update(eps=0.0), "eps must be finite"),
    (lambda s: s["settings"].update(lr=float("nan")), "lr must be finite"),
    (lambda s: s["state"]["sum"].__setitem__((2, 0), -1.0), "negative"),
    (lambda s: s["state"]["sum"].__setitem__((2, 0), np.inf), "infinite"),
])
def test_a_refused_state_dict_changes_nothing(spoil, match):
    source = nc.RowwiseAdagrad(nc.EmbeddingTable(hostile_weight(6)), 0.2)
    source.step_from_output_grad(*hostile_batch(0))
    state = source.state_dict()
    spoil(state)
    target = nc.RowwiseAdagrad(nc.EmbeddingTable(hostile_weight(6)), 0.1, eps=1e-7)
    target.step_from_output_grad(*hostile_batch(1))
    before = snapshot(target), target.settings()
    with pytest.raises(ValueError, match=match):
        target.load_state_dict(state)
    assert (snapshot(target), target.settings()) == before


def test_a_state_file_of_another_shard_is_refused(tmp_path):
    full = hostile_weight(7)
    shards = [nc.EmbeddingTable(full[start:start + 20].copy(), row_start=start, total_rows=ROWS)
              for start in (0, 20)]
    first = nc.SGD(shards[0], 0.1)
    path = nc.save_training_state(tmp_path / "rank0.safetensors", first)
    other = nc.SGD(shards[1], 0.1)
    before = snapshot(other)
    with pytest.raises(ValueError, match="another shard's"):
        nc.load_training_state(path, other)
    assert snapshot(other) == before
    whole = nc.SGD(nc.EmbeddingTable(full[:20].copy()), 0.1)  # same shape, not a shard
    with pytest.raises(ValueError, match=r"\[0, 20\) of 40, the optimizer's table \[0, 20\) of 20"):
        nc.load_training_state(path, whole)
    nc.load_training_state(path, nc.SGD(nc.EmbeddingTable(full[:20].copy(), total_rows=ROWS),
                                        0.1))


# --- closed tables -----------------------------------------------------------------------------


def test_a_step_after_close_is_refused():
    table = nc.EmbeddingTable(hostile_weight(8))
    optimizer = nc.SGD(table, 0.1)
    table.close()
    with pytest.raises(ValueError, match="closed"):
        optimizer.step_from_output_grad(*hostile_batch(0))
    with pytest.raises(ValueError, match="closed"):
        optimizer.step(nc.embedding_backward(*hostile_batch(0), num_rows=ROWS))
    assert optimizer.steps == 0


def test_a_closed_optimizer_or_table_steps_and_loads_no_more(tmp_path):
    optimizer = nc.RowwiseAdagrad(nc.EmbeddingTable(hostile_weight(8)), 0.1)
    path = nc.save_training_state(tmp_path / "s.safetensors", optimizer)
    optimizer.close()
    with pytest.raises(ValueError, match="the optimizer is closed"):
        optimizer.step_from_output_grad(*hostile_batch(0))
    with pytest.raises(ValueError, match="the optimizer is closed"):
        nc.load_training_state(path, optimizer)
    table = nc.EmbeddingTable(hostile_weight(8) + 1)
    loader = nc.RowwiseAdagrad(table, 0.1)
    table.close()
    with pytest.raises(ValueError, match="closed"):
        nc.load_training_state(path, loader)
    assert table.host_view.tobytes() == (hostile_weight(8) + 1).tobytes()


@pytest.mark.parametrize("write", ["step", "write_rows"])
def test_a_prefetch_before_a_write_reads_the_written_rows(write):
    table = nc.EmbeddingTable(hostile_weight(12))
    optimizer = nc.SGD(table, 0.5)
    ids, grad = hostile_batch(0, tokens=6)
    table.prefetch(ids)
    table.prefetcher.threads.wait()  # gathered before the write, surely
    if write == "step":
        optimizer.step_from_output_grad(ids, grad)
    else:
        table.write_rows(int(ids[0, 0]), np.full((1, DIM), 9.0, np.float32))
    rows = table.lookup(ids)
    assert rows.tobytes() == table.host_view[ids.reshape(-1)].reshape(rows.shape).tobytes()
    assert rows.tobytes() != hostile_weight(12)[ids.reshape(-1)].tobytes()


@pytest.mark.usefixtures("shm_dir")
def test_lookups_after_close_are_refused(tmp_path):
    ids = np.array([[1, 2]])
    shared = nc.EmbeddingTable(hostile_weight(9), placement="shared")
    config = nc.NGramConfig(vocab_size=50, ngram_size=3, heads_per_ngram=2,
                            ngram_vocab_size_base=11, eos_token_id=0, embedding_dim=8)
    layout = nc.layer_layout(config, 0)
    nc.save_ngram_embedding(tmp_path / "c", layout,
                            hostile_weight(9, layout.padded_rows, layout.head_dim))
    mapped = nc.load_ngram_embedding(tmp_path / "c", config, 0, placement="mmap").table
    for table in (shared, mapped):
        table.lookup(ids)
        table.close()
        with pytest.raises(ValueError, match=f"the table is closed: a '{table.placement}'"):
            table.lookup(ids)
        with pytest.raises(ValueError, match="the table is closed"):
            table.prefetch(ids)
    private = nc.EmbeddingTable(hostile_weight(9))
    private.close()  # its rows are this process's memory: they still serve
    assert private.lookup(ids).tobytes() == hostile_weight(9)[[1, 2]].reshape(1, -1).tobytes()


# --- shared tables written by training ---------------------------------------------------------


@pytest.mark.usefixtures("shm_dir")
def test_a_trained_shared_table_no_longer_answers_to_its_rows_name():
    rows = hostile_weight(10)
    trained = nc.EmbeddingTable(rows, placement="shared")
    partner = nc.EmbeddingTable(rows, placement="shared")  # attached before training: Hogwild
    optimizer = nc.SGD(trained, 0.5)
    optimizer.step_from_output_grad(*hostile_batch(0))
    assert partner.host_view.tobytes() == trained.host_view.tobytes() != rows.tobytes()
    fresh = nc.EmbeddingTable(rows, placement="shared")  # asks for rows' content: gets it
    assert fresh.host_view.tobytes() == rows.tobytes()
    assert fresh.storage.segment.created and fresh.storage.segment.name != \
        trained.storage.segment.name
    again = nc.EmbeddingTable(rows, placement="shared")  # the fresh one, never written
    assert again.storage.segment.name == fresh.storage.segment.name
    for table in (trained, partner, fresh, again):
        table.close()
    optimizer.close()


@pytest.mark.usefixtures("shm_dir")
def test_hogwild_adam_counts_steps_per_process():
    """Documented (docs/training.md): each process's Adam keeps its own step count, so on
    disjoint rows Hogwild equals each process's Adam stepping alone on its batches."""
    rows = hostile_weight(11)
    tables = [nc.EmbeddingTable(rows, placement="shared") for _ in range(2)]
    hogwild = [nc.Adam(table, 0.01) for table in tables]  # two "processes", one state segment
    alone = [nc.Adam(nc.EmbeddingTable(rows.copy()), 0.01) for _ in range(2)]
    for step in range(3):
        for half, (one, solo) in enumerate(zip(hogwild, alone, strict=True)):
            ids, grad = hostile_batch(step, rows=20 * (half + 1), low=20 * half)
            one.step_from_output_grad(ids, grad)
            solo.step_from_output_grad(ids, grad)
    assert [one.steps for one in hogwild] == [3, 3]
    expect = np.concatenate([alone[0].table.host_view[:20], alone[1].table.host_view[20:]])
    assert tables[0].host_view.tobytes() == expect.tobytes()
    for one, table in zip(hogwild, tables, strict=True):
        one.close()
        table.close()


# --- schedules, state loads and writers beside an asynchronous update (hostile pass 5) --------


def test_silent_wrong_a_learning_rate_set_after_an_asynchronous_step_applies_from_the_next():
    ids, grad = hostile_batch(0)
    reference = nc.SGD(nc.EmbeddingTable(hostile_weight(13)), 0.1)
    reference.step_from_output_grad(ids, grad)
    optimizer = nc.SGD(nc.EmbeddingTable(hostile_weight(13)), 0.1, asynchronous=True)
    gate = gated(optimizer)
    optimizer.step_from_output_grad(ids, grad)  # issued with lr 0.1, not yet applied
    optimizer.lr = 100.0  # a schedule's next value
    gate.set()
    optimizer.synchronize()
    assert optimizer.table.host_view.tobytes() == reference.table.host_view.tobytes()


@pytest.mark.parametrize("make, name, value", [
    (lambda t: nc.SGD(t, 0.1), "lr", -1.0),
    (lambda t: nc.RowwiseAdagrad(t, 0.1), "eps", 0.0),  # zero-gradient rows would become NaN
    (lambda t: nc.RowwiseAdagrad(t, 0.1), "weight_decay_mode", "bogus"),
    (lambda t: nc.SGD(t, 0.1), "max_norm", -1.0),
    (lambda t: nc.Adam(t, 0.1), "betas", (1.5, 0.9)),
])
def test_silent_wrong_settings_assigned_later_are_checked(make, name, value):
    optimizer = make(nc.EmbeddingTable(hostile_weight(14)))
    with pytest.raises((ValueError, TypeError), match=name):
        setattr(optimizer, name, value)
    before = snapshot(optimizer)
    optimizer.step_from_output_grad(*hostile_batch(0))  # the old, valid setting still steps
    assert snapshot(optimizer) != before and np.isfinite(optimizer.table.host_view).all()


@pytest.mark.parametrize("resharded", [False, True])
def test_silent_wrong_a_prefetch_before_a_state_load_reads_the_loaded_rows(tmp_path, resharded):
    saved = nc.SGD(nc.EmbeddingTable(hostile_weight(15)), 0.5)
    saved.step_from_output_grad(*hostile_batch(0))
    path = nc.save_training_state(tmp_path / "s.safetensors", saved)
    table = nc.EmbeddingTable(hostile_weight(15))
    ids = hostile_batch(0)[0]
    table.prefetch(ids)
    table.prefetcher.threads.wait()  # gathered the old rows, surely
    options = {"rank": 0, "world_size": 1} if resharded else {}
    nc.load_training_state([path] if resharded else path, nc.SGD(table, 0.5), **options)
    rows = table.lookup(ids)
    assert rows.tobytes() == saved.table.host_view[ids.reshape(-1)].reshape(rows.shape).tobytes()


def test_data_loss_a_step_waits_for_another_optimizers_pending_update():
    ids, grad = hostile_batch(1)
    rules = {"weight_decay": 0.5}  # each update reads the row: the order shows
    table = nc.EmbeddingTable(hostile_weight(16))
    first, second = nc.SGD(table, 0.1, asynchronous=True, **rules), nc.SGD(table, 0.2, **rules)
    reference = nc.EmbeddingTable(hostile_weight(16))
    for lr in (0.1, 0.2):
        nc.SGD(reference, lr, **rules).step_from_output_grad(ids, grad)
    gate = gated(first)
    first.step_from_output_grad(ids, grad)
    threading.Timer(0.2, gate.set).start()  # the worker is busy a while
    second.step_from_output_grad(ids, grad)  # must land after the first optimizer's update
    assert table.host_view.tobytes() == reference.host_view.tobytes()
    first.close()


def test_crash_a_state_dict_step_count_past_64_bits_is_refused():
    optimizer = nc.Adam(nc.EmbeddingTable(hostile_weight(17)), 0.1)
    state = optimizer.state_dict()
    state["steps"] = 2**70  # the next step's count would not fit the kernels' uint64
    with pytest.raises(ValueError, match=r"state\['steps'\] must be a step count"):
        optimizer.load_state_dict(state)
    assert optimizer.steps == 0
    optimizer.step_from_output_grad(*hostile_batch(0))
