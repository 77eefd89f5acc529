"""embedding_backward against a plain NumPy reference: float64 sums in the ids' order, rounded
once; the same bits for any thread count, the ids' sides (NumPy, torch) and the simulated GPU."""

from __future__ import annotations

import ml_dtypes
import numba
import numpy as np
import pytest

import ngram_cupy as nc
from ngram_cupy.training import backward_cuda, backward_numba


def reference_backward(ids: np.ndarray, grad: np.ndarray):
    """Distinct ids sorted; each one's gradient rows added one by one in float64, in order."""
    flat = ids.reshape(-1)
    rows = grad.reshape(flat.shape[0], -1).astype(np.float64)
    unique = np.unique(flat)
    values = np.zeros((unique.shape[0], rows.shape[1]), np.float64)
    for u, row in enumerate(unique):
        for position in np.flatnonzero(flat == row):
            values[u] += rows[position]
    return unique.astype(np.int64), values.astype(np.float32)


def gradient_batch(seed: int, tokens=64, heads=4, dim=8, rows=50):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, rows, (tokens, heads))
    magnitudes = 10.0 ** rng.integers(-3, 3, (tokens, heads, 1))
    grad = (rng.standard_normal((tokens, heads, dim)) * magnitudes).astype(np.float32)
    return ids, grad


@pytest.mark.parametrize("shape", ["flat", "heads", "merged"])
def test_backward_matches_the_reference_bitwise(shape):
    ids, grad = gradient_batch(0)
    want_rows, want_values = reference_backward(ids, grad)
    if shape == "flat":
        args = ids.reshape(-1), grad.reshape(-1, grad.shape[2])
    elif shape == "heads":
        args = ids, grad
    else:
        args = ids, grad.reshape(ids.shape[0], -1)
    got = nc.embedding_backward(*args, num_rows=50)
    assert got.indices.dtype == np.int64 and got.values.dtype == np.float32
    np.testing.assert_array_equal(got.indices, want_rows)
    assert got.values.tobytes() == want_values.tobytes()


def test_both_groupings_and_thread_counts_give_the_same_bits():
    ids, grad = gradient_batch(1, tokens=2048, rows=300)
    flat, rows = ids.reshape(-1), grad.reshape(-1, grad.shape[2])
    results = []
    for grouping_rows in (300, 10**9):  # counting sort, then NumPy's stable sort
        order, unique, starts = backward_numba.sorted_order(flat, 0, grouping_rows)
        for threads in (1, numba.config.NUMBA_NUM_THREADS):
            numba.set_num_threads(threads)
            values = np.empty((unique.shape[0], rows.shape[1]), np.float32)
            backward_numba.segment_sums(rows, order, starts, values)
            results.append((unique.tobytes(), values.tobytes()))
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    assert len(set(results)) == 1
    assert results[0][1] == reference_backward(ids, grad)[1].tobytes()


def test_batch_order_does_not_change_the_bits():
    ids, grad = gradient_batch(2)
    permutation = np.random.default_rng(3).permutation(ids.shape[0])
    first = nc.embedding_backward(ids, grad)
    second = nc.embedding_backward(ids[permutation], grad[permutation])
    assert first.values.tobytes() == second.values.tobytes()


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16])
def test_half_precision_gradients_widen_exactly(dtype):
    ids, grad = gradient_batch(4)
    half = grad.astype(dtype)
    got = nc.embedding_backward(ids, half)
    assert got.values.tobytes() == reference_backward(ids, half.astype(np.float32))[1].tobytes()


def test_torch_in_gives_torch_out():
    torch = pytest.importorskip("torch")
    ids, grad = gradient_batch(5)
    got = nc.embedding_backward(torch.from_numpy(ids), torch.from_numpy(grad).bfloat16())
    assert isinstance(got.values, torch.Tensor)
    want = reference_backward(ids, torch.from_numpy(grad).bfloat16().float().numpy())
    np.testing.assert_array_equal(got.indices.numpy(), want[0])
    assert got.values.numpy().tobytes() == want[1].tobytes()


def test_simulated_gpu_kernel_gives_the_cpu_bits(simulate):
    ids, grad = gradient_batch(6, tokens=6, heads=2, dim=3, rows=4)
    flat, rows = ids.reshape(-1), grad.reshape(-1, 3)
    order, unique, starts = backward_numba.sorted_order(flat, 0, 4)
    out = np.empty((unique.shape[0], 3), np.float32)
    backward_cuda.launch_segment_sums(rows, order, starts, out)
    assert out.tobytes() == reference_backward(ids, grad)[1].tobytes()


def test_bad_inputs_name_the_argument():
    ids, grad = gradient_batch(7, tokens=4)
    bad = ids.copy()
    bad[2, 1] = 50
    with pytest.raises(IndexError, match=r"^ids\[2, 1\] = 50 is outside the table's rows "
                                         r"\[0, 50\) \(the first such id, at flat position 9\)$"):
        nc.embedding_backward(bad, grad, num_rows=50)
    bad[2, 1] = -1
    with pytest.raises(IndexError, match=r"^ids\[2, 1\] = -1 is outside"):
        nc.embedding_backward(bad, grad)
    with pytest.raises(ValueError, match="grad_out must have shape"):
        nc.embedding_backward(ids, grad[:3])
    with pytest.raises(TypeError, match="grad_out must be float32"):
        nc.embedding_backward(ids, grad.astype(np.float64))
    with pytest.raises(TypeError, match="ids must be int32 or int64"):
        nc.embedding_backward(ids.astype(np.float32), grad)
