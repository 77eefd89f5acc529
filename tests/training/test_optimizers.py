"""Row-wise optimizers against plain NumPy references of their formulas, bitwise (float32
arithmetic, float64 means summed in order), and Adam against torch.optim.SparseAdam."""

from __future__ import annotations

import ml_dtypes
import numba
import numpy as np
import pytest
from helpers import in_order_sum

import ngram_cupy as nc

ROWS, DIM = 40, 8


def table_weight(seed=0, rows=ROWS, dim=DIM):
    return np.random.default_rng(seed).standard_normal((rows, dim)).astype(np.float32)


def update_batch(seed, tokens=24, heads=3, rows=ROWS, dim=DIM):
    rng = np.random.default_rng(100 + seed)
    return (rng.integers(0, rows, (tokens, heads)),
            rng.standard_normal((tokens, heads, dim)).astype(np.float32))


def ref_sgd(w, rows, g, lr):
    w[rows] = w[rows] - np.float32(lr) * g


def ref_rowwise_adagrad(w, s, rows, g, lr, eps, decay):
    if decay:
        g = g + np.float32(decay) * w[rows]
    mean = (in_order_sum(g.astype(np.float64) ** 2) / g.shape[1]).astype(np.float32)
    s[rows] = s[rows] + mean
    scale = np.float32(lr) / (np.sqrt(s[rows]) + np.float32(eps))
    w[rows] = w[rows] - scale[:, None] * g


def ref_rowwise_adam(w, m, v, rows, g, step, lr, betas, eps):
    b1, b2 = np.float32(1 - betas[0]), np.float32(1 - betas[1])
    step_size = np.float32(lr * np.sqrt(1 - betas[1] ** step) / (1 - betas[0] ** step))
    mean = (in_order_sum(g) / g.shape[1]).astype(np.float32)
    mean_square = (in_order_sum(g.astype(np.float64) ** 2) / g.shape[1]).astype(np.float32)
    m[rows] = m[rows] + (mean - m[rows]) * b1
    v[rows] = v[rows] + (mean_square - v[rows]) * b2
    denom = np.sqrt(v[rows]) + np.float32(eps)
    w[rows] = w[rows] - step_size * (((g - mean[:, None]) + m[rows][:, None]) / denom[:, None])


def run_steps(optimizer_class, kwargs, weight, steps=3, fused=True, dtype=np.float32):
    table = nc.EmbeddingTable(weight.astype(dtype))
    optimizer = optimizer_class(table, **kwargs)
    for step in range(steps):
        ids, grad = update_batch(step)
        if fused:
            optimizer.step_from_output_grad(ids, grad)
        else:
            optimizer.step(nc.embedding_backward(ids, grad, num_rows=ROWS))
    return table, optimizer


@pytest.mark.parametrize("fused", [True, False])
def test_sgd_matches_the_reference(fused):
    weight = table_weight()
    table, _ = run_steps(nc.SGD, {"lr": 0.05}, weight, fused=fused)
    want = weight.copy()
    for step in range(3):
        grads = nc.embedding_backward(*update_batch(step))
        ref_sgd(want, grads.indices, grads.values, 0.05)
    assert table.host_view.tobytes() == want.tobytes()


@pytest.mark.parametrize("decay", [0.0, 0.01])
def test_rowwise_adagrad_matches_the_reference(decay):
    weight = table_weight(1)
    kwargs = {"lr": 0.1, "eps": 1e-8, "weight_decay": decay}
    table, optimizer = run_steps(nc.RowwiseAdagrad, kwargs, weight)
    want, s = weight.copy(), np.zeros(ROWS, np.float32)
    for step in range(3):
        grads = nc.embedding_backward(*update_batch(step))
        ref_rowwise_adagrad(want, s, grads.indices, grads.values, 0.1, 1e-8, decay)
    assert table.host_view.tobytes() == want.tobytes()
    assert optimizer.state["sum"].ravel().tobytes() == s.tobytes()
    assert optimizer.state_bytes_per_row == 4


def test_rowwise_adam_matches_the_reference():
    weight = table_weight(2)
    kwargs = {"lr": 0.01, "betas": (0.8, 0.99), "eps": 1e-6, "rowwise": True}
    table, optimizer = run_steps(nc.Adam, kwargs, weight)
    want, m, v = weight.copy(), np.zeros(ROWS, np.float32), np.zeros(ROWS, np.float32)
    for step in range(3):
        grads = nc.embedding_backward(*update_batch(step))
        ref_rowwise_adam(want, m, v, grads.indices, grads.values, step + 1, 0.01, (0.8, 0.99),
                         1e-6)
    assert table.host_view.tobytes() == want.tobytes()
    assert optimizer.state_bytes_per_row == 8


def ref_sparse_adam(w, m, v, rows, g, step, lr, betas, eps):
    """SparseAdam's operations in float32, in its order (correctly rounded square roots)."""
    b1, b2 = np.float32(1 - betas[0]), np.float32(1 - betas[1])
    step_size = np.float32(lr * np.sqrt(1 - betas[1] ** step) / (1 - betas[0] ** step))
    m_change = (g - m[rows]) * b1
    v_change = (g * g - v[rows]) * b2
    numer, denom = m_change + m[rows], np.sqrt(v_change + v[rows]) + np.float32(eps)
    m[rows] += m_change
    v[rows] += v_change
    w[rows] += -step_size * (numer / denom)


def test_adam_matches_sparse_adams_formula_bitwise_and_torch():
    torch = pytest.importorskip("torch")
    weight = table_weight(3)
    table, optimizer = run_steps(nc.Adam, {"lr": 0.01}, weight, steps=4)
    want, m, v = weight.copy(), np.zeros_like(weight), np.zeros_like(weight)
    for step in range(4):
        grads = nc.embedding_backward(*update_batch(step))
        ref_sparse_adam(want, m, v, grads.indices, grads.values, step + 1, 0.01, (0.9, 0.999),
                        1e-8)
    assert table.host_view.tobytes() == want.tobytes()
    assert optimizer.state["exp_avg_sq"].tobytes() == v.tobytes()
    param = torch.nn.Parameter(torch.from_numpy(weight.copy()))
    sparse_adam = torch.optim.SparseAdam([param], lr=0.01)
    for step in range(4):
        grads = nc.embedding_backward(*update_batch(step))
        param.grad = torch.sparse_coo_tensor(torch.from_numpy(grads.indices)[None],
                                             torch.from_numpy(grads.values), (ROWS, DIM))
        sparse_adam.step()
    # torch's float32 sqrt is not always correctly rounded (1 ulp off on ~20% of values here):
    # the rows agree within a few ulps, the first moment (no sqrt) bit for bit
    torch_rows = param.detach().numpy()
    ulps = np.abs(table.host_view.view(np.int32) - torch_rows.view(np.int32))
    assert ulps.max() <= 4
    exp_avg = sparse_adam.state[param]["exp_avg"].numpy()
    assert optimizer.state["exp_avg"].tobytes() == exp_avg.tobytes()
    assert optimizer.state_bytes_per_row == 2 * 4 * DIM


def test_bfloat16_tables_round_to_nearest_even():
    weight = table_weight(4).astype(ml_dtypes.bfloat16)
    table, _ = run_steps(nc.SGD, {"lr": 0.05}, weight.astype(np.float32), dtype=ml_dtypes.bfloat16)
    want = weight.copy()
    for step in range(3):
        grads = nc.embedding_backward(*update_batch(step))
        rows = want[grads.indices].astype(np.float32) - np.float32(0.05) * grads.values
        want[grads.indices] = rows.astype(ml_dtypes.bfloat16)
    assert table.host_view.tobytes() == want.tobytes()


def test_stochastic_rounding_is_reproducible_and_brackets_the_value():
    weight = table_weight(5).astype(ml_dtypes.bfloat16).astype(np.float32)
    ids, grad = update_batch(0)
    results = []
    for seed, threads in ((7, 1), (7, numba.config.NUMBA_NUM_THREADS), (8, 1)):
        numba.set_num_threads(threads)
        table = nc.EmbeddingTable(weight.astype(ml_dtypes.bfloat16))
        nc.SGD(table, 0.05, stochastic_rounding=True, seed=seed).step_from_output_grad(ids, grad)
        results.append(table.host_view.astype(np.float32))
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    assert results[0].tobytes() == results[1].tobytes()
    assert results[0].tobytes() != results[2].tobytes()
    grads = nc.embedding_backward(ids, grad)
    exact = weight[grads.indices] - np.float32(0.05) * grads.values
    down = exact.astype(ml_dtypes.bfloat16).astype(np.float32)
    got = results[0][grads.indices]
    step = np.abs(np.nextafter(down.astype(ml_dtypes.bfloat16), ml_dtypes.bfloat16(np.inf))
                  .astype(np.float32) - down)
    assert (np.abs(got - exact) <= step).all()


def test_state_dict_round_trip_continues_with_the_same_bits():
    weight = table_weight(6)
    straight, _ = run_steps(nc.RowwiseAdagrad, {"lr": 0.1}, weight, steps=4)
    first, optimizer = run_steps(nc.RowwiseAdagrad, {"lr": 0.1}, weight, steps=2)
    resumed_table = nc.EmbeddingTable(first.host_view.copy())
    resumed = nc.RowwiseAdagrad(resumed_table, 0.1)
    resumed.load_state_dict(optimizer.state_dict())
    for step in (2, 3):
        resumed.step_from_output_grad(*update_batch(step))
    assert resumed_table.host_view.tobytes() == straight.host_view.tobytes()


def test_refused_steps_change_nothing():
    weight = table_weight(7)
    table = nc.EmbeddingTable(weight.copy())
    optimizer = nc.RowwiseAdagrad(table, 0.1)
    ids, grad = update_batch(0)
    bad_ids = ids.copy()
    bad_ids[5, 2] = ROWS
    with pytest.raises(IndexError, match=rf"^ids\[5, 2\] = {ROWS} is outside"):
        optimizer.step_from_output_grad(bad_ids, grad)
    nan = grad.copy()
    nan[3, 1, 2] = np.nan
    with pytest.raises(ValueError, match="NaN or infinite"):
        optimizer.step_from_output_grad(ids, nan)
    with pytest.raises(ValueError, match="grad_out must have shape"):
        optimizer.step_from_output_grad(ids, grad[:, :2])
    with pytest.raises(ValueError, match="state is for a table of shape"):
        optimizer.load_state_dict(nc.RowwiseAdagrad(nc.EmbeddingTable(weight[:5].copy()),
                                                    0.1).state_dict())
    with pytest.raises(ValueError, match="not a rowwise_adagrad state dict"):
        optimizer.load_state_dict(nc.SGD(nc.EmbeddingTable(weight.copy()), 0.1).state_dict())
    assert table.host_view.tobytes() == weight.tobytes()
    assert not optimizer.state["sum"].any() and optimizer.steps == 0


@pytest.mark.parametrize("lr", [float("nan"), float("inf"), -1.0])
def test_learning_rates_must_be_finite(lr):
    with pytest.raises(ValueError, match="lr must be finite"):
        nc.SGD(nc.EmbeddingTable(table_weight()), lr)


def test_tables_that_cannot_train_say_why():
    weight = table_weight()
    with pytest.raises(ValueError, match="float8_e4m3fn tables cannot be trained"):
        nc.SGD(nc.EmbeddingTable(weight.astype(ml_dtypes.float8_e4m3fn), scale=1.0), 0.1)
    closed = nc.EmbeddingTable(weight.copy())
    closed.close()
    with pytest.raises(ValueError, match="closed"):
        nc.SGD(closed, 0.1)
    frozen = weight.copy()
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        nc.SGD(nc.EmbeddingTable(frozen), 0.1)


def test_tiered_hot_rows_stay_coherent():
    weight = table_weight(8)
    hot = np.array([0, 3, 7, 20], np.int64)
    table = nc.EmbeddingTable(weight.copy(), hot_rows=hot)
    nc.RowwiseAdagrad(table, 0.1).step_from_output_grad(*update_batch(0))
    ids = np.arange(ROWS).reshape(-1, 1)
    plain = nc.EmbeddingTable(table.host_view.copy())
    assert table.lookup(ids).tobytes() == plain.lookup(ids).tobytes()
    assert table.counters["hot_rows"] == len(hot)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_a_saved_training_state_resumes_with_the_same_bits(tmp_path, dtype):
    weight = table_weight(9).astype(dtype)
    kwargs = {"lr": 0.01, "rowwise": True}
    straight, _ = run_steps(nc.Adam, kwargs, weight.astype(np.float32), steps=4, dtype=dtype)
    _, first = run_steps(nc.Adam, kwargs, weight.astype(np.float32), steps=2, dtype=dtype)
    path = nc.save_training_state(tmp_path / "train.safetensors", first)
    resumed = nc.Adam(nc.EmbeddingTable(np.zeros((ROWS, DIM), dtype)), **kwargs)
    nc.load_training_state(path, resumed)
    for step in (2, 3):
        resumed.step_from_output_grad(*update_batch(step))
    assert resumed.table.host_view.tobytes() == straight.host_view.tobytes()
    other = nc.RowwiseAdagrad(nc.EmbeddingTable(np.zeros((ROWS, DIM), dtype)), 0.1)
    with pytest.raises(ValueError, match="not a rowwise_adagrad state dict"):
        nc.load_training_state(path, other)
    assert not other.table.host_view.astype(np.float32).any()


def test_pinned_tables_train_as_cpu_ones_and_mapped_ones_refuse():
    from ngram_cupy.formats import storage_format
    from ngram_cupy.tables.storage.mapped import MappedStorage

    weight = table_weight(10)
    cpu, _ = run_steps(nc.RowwiseAdagrad, {"lr": 0.1}, weight)
    pinned = nc.EmbeddingTable(weight.copy(), placement="pinned")
    optimizer = nc.RowwiseAdagrad(pinned, 0.1)
    for step in range(3):
        optimizer.step_from_output_grad(*update_batch(step))
    assert pinned.host_view.tobytes() == cpu.host_view.tobytes()
    mapped = MappedStorage([(0, weight)], DIM, storage_format("float32"), pageable=False)
    with pytest.raises(ValueError, match="'mmap' tables are read-only"):
        nc.SGD(nc.EmbeddingTable(mapped), 0.1)
