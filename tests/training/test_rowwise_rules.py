"""FBGEMM's row-wise rules (decoupled weight decay, the max-norm clamp) on SGD and row-wise
Adagrad, bitwise against NumPy transcriptions of docs/training.md's formulas."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from helpers import in_order_sum

import ngram_cupy as nc

ROWS, DIM = 40, 8


def rule_table_weight(seed=0):
    return np.random.default_rng(seed).standard_normal((ROWS, DIM)).astype(np.float32)


def rule_batch(seed, tokens=24, heads=3):
    rng = np.random.default_rng(200 + seed)
    return (rng.integers(0, ROWS, (tokens, heads)),
            rng.standard_normal((tokens, heads, DIM)).astype(np.float32))


def clamp(new: np.ndarray, max_norm) -> np.ndarray:
    """``n = float32(sqrt(sum(w * w)))`` (float64, in order); rows with ``n > max_norm``
    times ``max_norm / n``."""
    if max_norm is None:
        return new
    norm = np.sqrt(in_order_sum(new.astype(np.float64) ** 2)).astype(np.float32)
    factor = np.float32(max_norm) / norm
    return np.where((norm > np.float32(max_norm))[:, None], new * factor[:, None], new)


def ref_decayed_sgd(w, rows, g, lr, decay, mode, max_norm):
    lr, decay = np.float32(lr), np.float32(decay)
    if mode == "l2":
        g = g + decay * w[rows] if decay else g
        new = w[rows] - lr * g
    else:
        new = (np.float32(1) - lr * decay) * w[rows] - lr * g
    w[rows] = clamp(new, max_norm)


def ref_adagrad(w, s, rows, g, lr, eps, decay, mode, max_norm):
    lr, eps, decay = np.float32(lr), np.float32(eps), np.float32(decay)
    if mode == "l2" and decay:
        g = g + decay * w[rows]
    s[rows] = s[rows] + (in_order_sum(g.astype(np.float64) ** 2) / DIM).astype(np.float32)
    m = (lr / (np.sqrt(s[rows]) + eps))[:, None]
    keep = np.float32(1) - lr * decay if mode == "decoupled" else np.float32(1)
    w[rows] = clamp(keep * w[rows] - m * g, max_norm)


def train_steps(optimizer, steps=3, fused=True):
    for step in range(steps):
        ids, grad = rule_batch(step)
        if fused:
            optimizer.step_from_output_grad(ids, grad)
        else:
            optimizer.step(nc.embedding_backward(ids, grad, num_rows=ROWS))


CASES = [("decoupled", None), ("l2", 1.5), ("decoupled", 1.5)]


@pytest.mark.parametrize(("mode", "max_norm"), CASES)
@pytest.mark.parametrize("fused", [True, False])
def test_rowwise_adagrad_rules_match_the_formula(mode, max_norm, fused):
    weight = rule_table_weight(1)
    table = nc.EmbeddingTable(weight.copy())
    optimizer = nc.RowwiseAdagrad(table, 0.3, eps=1e-6, weight_decay=0.25,
                                  weight_decay_mode=mode, max_norm=max_norm)
    train_steps(optimizer, fused=fused)
    want, s = weight.copy(), np.zeros(ROWS, np.float32)
    for step in range(3):
        grads = nc.embedding_backward(*rule_batch(step))
        ref_adagrad(want, s, grads.indices, grads.values, 0.3, 1e-6, 0.25, mode, max_norm)
    assert table.host_view.tobytes() == want.tobytes()
    assert optimizer.state["sum"].ravel().tobytes() == s.tobytes()


@pytest.mark.parametrize(("mode", "max_norm"), [("l2", None), *CASES])
def test_sgd_rules_match_the_formula(mode, max_norm):
    weight = rule_table_weight(2)
    table = nc.EmbeddingTable(weight.copy())
    train_steps(nc.SGD(table, 0.2, weight_decay=0.5, weight_decay_mode=mode, max_norm=max_norm))
    want = weight.copy()
    for step in range(3):
        grads = nc.embedding_backward(*rule_batch(step))
        ref_decayed_sgd(want, grads.indices, grads.values, 0.2, 0.5, mode, max_norm)
    assert table.host_view.tobytes() == want.tobytes()


def test_the_modes_differ_and_the_clamp_bites_only_long_rows():
    weight = rule_table_weight(3)
    results = {}
    for mode in ("l2", "decoupled"):
        table = nc.EmbeddingTable(weight.copy())
        train_steps(nc.RowwiseAdagrad(table, 0.3, weight_decay=0.25, weight_decay_mode=mode))
        results[mode] = table.host_view.copy()
    assert results["l2"].tobytes() != results["decoupled"].tobytes()
    table = nc.EmbeddingTable(weight.copy())
    train_steps(nc.RowwiseAdagrad(table, 0.3, weight_decay=0.25, max_norm=2.0))
    touched = np.unique(np.concatenate([rule_batch(step)[0].ravel() for step in range(3)]))
    free = np.linalg.norm(results["l2"][touched].astype(np.float64), axis=1)
    clamped = np.linalg.norm(table.host_view[touched].astype(np.float64), axis=1)
    assert (free > 2.0).any() and (free <= 2.0).any()  # both kinds of rows occur
    assert (clamped <= 2.0 * (1 + 1e-6)).all()
    untouched = np.setdiff1d(np.arange(ROWS), touched)
    assert table.host_view[untouched].tobytes() == weight[untouched].tobytes()


def test_bfloat16_rows_are_clamped_in_float32_then_rounded():
    weight = rule_table_weight(4).astype(ml_dtypes.bfloat16)
    table = nc.EmbeddingTable(weight.copy())
    train_steps(nc.SGD(table, 0.2, weight_decay=0.5, weight_decay_mode="decoupled", max_norm=1.5))
    want = weight.copy()
    for step in range(3):
        grads = nc.embedding_backward(*rule_batch(step))
        rows = want[grads.indices].astype(np.float32)
        new = (np.float32(1) - np.float32(0.2) * np.float32(0.5)) * rows \
            - np.float32(0.2) * grads.values
        want[grads.indices] = clamp(new, 1.5).astype(ml_dtypes.bfloat16)
    assert table.host_view.tobytes() == want.tobytes()


def test_the_rules_are_in_the_state_dict():
    table = nc.EmbeddingTable(rule_table_weight())
    state = nc.RowwiseAdagrad(table, 0.1, weight_decay=0.01, weight_decay_mode="decoupled",
                              max_norm=3.0).state_dict()
    assert state["settings"] == {"lr": 0.1, "eps": 1e-8, "weight_decay": 0.01,
                                 "weight_decay_mode": "decoupled", "max_norm": 3.0,
                                 "stochastic_rounding": False, "seed": 0}
    assert nc.SGD(table, 0.1).state_dict()["settings"]["max_norm"] is None


@pytest.mark.parametrize("optimizer", [nc.SGD, nc.RowwiseAdagrad])
def test_bad_rules_name_the_argument(optimizer):
    table = nc.EmbeddingTable(rule_table_weight())
    with pytest.raises(ValueError, match="weight_decay_mode must be one of"):
        optimizer(table, 0.1, weight_decay_mode="l1")
    for bad in (0.0, -1.0, float("nan"), 1e-50):
        with pytest.raises(ValueError, match="max_norm must be"):
            optimizer(table, 0.1, max_norm=bad)
    with pytest.raises(TypeError, match="max_norm must be a number"):
        optimizer(table, 0.1, max_norm="1")
    with pytest.raises(ValueError, match="weight_decay must be finite"):
        optimizer(table, 0.1, weight_decay=-0.5)


def test_the_clamp_keeps_overflowed_rows_finite():
    """Rows past float32's range, or holding infinities, are clamped to finite rows of norm
    max_norm in their direction (docs/training.md), never NaN."""
    weight = rule_table_weight()
    huge = np.float32(3e38)
    weight[1, :2] = huge  # finite values whose float32 norm overflows
    weight[2, :4] = [np.inf, 1.0, -np.inf, 2.0]  # an overflowed row
    weight[3, 0] = -huge  # overflows in this step: -3e38 - 0.5 * 1e38
    table = nc.EmbeddingTable(weight)
    optimizer = nc.SGD(table, lr=0.5, max_norm=1.0)
    grad = np.zeros((3, DIM), np.float32)
    grad[2, 0] = 1e38
    optimizer.step(nc.SparseRows(np.array([1, 2, 3]), grad))
    rows = table.host_view[1:4]
    part = np.float32(1 / np.sqrt(2))
    expected = np.zeros((3, DIM), np.float32)
    wide = weight[1].astype(np.float64)
    expected[0] = wide * (1.0 / np.sqrt(in_order_sum(wide[None] ** 2)[0]))  # scaled in float64
    expected[1, [0, 2]] = part, -part
    expected[2, 0] = -1.0
    assert np.isfinite(rows).all()
    np.testing.assert_array_equal(rows, expected)
