"""CPU kernel of every row-wise update: each distinct row's gradient summed (float64, rounded
once), then the optimizer's formula in float32, the row written back (bfloat16: rounded to
nearest even, or stochastically from a counter-based hash: reproducible for any thread count)."""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..formats import BFLOAT16, FLOAT32
from ..tables.dequant import bits_to_float32, float32_to_bits

SGD, ROWWISE_ADAGRAD, ADAM, ROWWISE_ADAM = 0, 1, 2, 3
# The row formats ``update_rows`` loads and stores (``load``, ``store``).
ROW_FORMATS = (FLOAT32, BFLOAT16)
# Hyper-parameters, float32, in this order: lr, eps, weight decay, 1 - beta1, 1 - beta2, step.
LR, EPS, DECAY, ONE_MINUS_BETA1, ONE_MINUS_BETA2, STEP_SIZE = range(6)
BLOCK = 64
GOLDEN = np.uint64(0x9E3779B97F4A7C15)
MIX1 = np.uint64(0xBF58476D1CE4E5B9)
MIX2 = np.uint64(0x94D049BB133111EB)
LOW16 = np.uint32(0xFFFF)
HALF_MINUS_ONE = np.uint32(0x7FFF)
QUIET = np.uint32(0x40)
ONE = np.uint32(1)
SHIFT16 = np.uint32(16)


@njit(inline="always")
def noise16(seed, step, position):
    """16 random bits of (seed, step, position): splitmix64's finaliser of their mix."""
    z = np.uint64(seed) + np.uint64(step) * GOLDEN + np.uint64(position) * MIX2
    z = (z ^ (z >> np.uint64(30))) * MIX1
    z = (z ^ (z >> np.uint64(27))) * MIX2
    z = z ^ (z >> np.uint64(31))
    return np.uint32(z & np.uint64(0xFFFF))


@njit(inline="always")
def bfloat16_bits(value, noise, stochastic):
    """``value`` (float32) rounded to bfloat16 bits: to nearest even, or up with probability the
    dropped fraction (``noise``: 16 uniform bits)."""
    bits = float32_to_bits(value)
    if value != value:
        return np.uint16((bits >> SHIFT16) | QUIET)
    if stochastic:
        bits = bits + noise
    else:
        bits = bits + HALF_MINUS_ONE + ((bits >> SHIFT16) & ONE)
    return np.uint16(bits >> SHIFT16)


@njit(inline="always")
def load(rows, r, d, code):
    """Row ``r``'s value ``d`` (float32 or bfloat16 bits, format ``code``) as float32."""
    if code == BFLOAT16:
        return bits_to_float32(np.uint32(rows[r, d]) << SHIFT16)
    return bits_to_float32(np.uint32(rows[r, d]))


@njit(inline="always")
def store(rows, r, d, value, code, stochastic, seed, step, row_start):
    """Write float32 ``value`` to local row ``r``'s value ``d`` in the table's format ``code``
    (the rounding noise hashes the global row, ``row_start + r``: a shard rounds as the whole
    table does)."""
    if code == BFLOAT16:
        position = (row_start + r) * rows.shape[1] + d
        noise = noise16(seed, step, position) if stochastic else np.uint32(0)
        rows[r, d] = bfloat16_bits(value, noise, stochastic)
    else:
        rows[r, d] = float32_to_bits(value)


@njit(cache=True, nogil=True, parallel=True)
def update_rows(kind, rows, code, row_start, local, order, starts, grad, first, second, hyper,
                stochastic, seed, step):
    """Apply optimizer ``kind`` to local rows ``local[u]`` (global ``row_start + local[u]``),
    whose gradient is the float64 sum of ``grad[order[starts[u]:starts[u + 1]]]`` rounded to
    float32; state in ``first`` / ``second`` (float32 ``[rows, D]`` or ``[rows, 1]``)."""
    count, width = local.shape[0], grad.shape[1]
    lr, eps, decay = hyper[LR], hyper[EPS], hyper[DECAY]
    b1, b2, step_size = hyper[ONE_MINUS_BETA1], hyper[ONE_MINUS_BETA2], hyper[STEP_SIZE]
    for block in prange((count + BLOCK - 1) // BLOCK):
        acc = np.empty(width, np.float64)
        g = np.empty(width, np.float32)
        for u in range(block * BLOCK, min(count, (block + 1) * BLOCK)):
            r = local[u]
            acc[:] = 0.0
            for k in range(starts[u], starts[u + 1]):
                source = order[k]
                for d in range(width):
                    acc[d] += grad[source, d]
            for d in range(width):
                g[d] = np.float32(acc[d])
            if kind == SGD:
                for d in range(width):
                    store(rows, r, d, load(rows, r, d, code) - lr * g[d], code, stochastic,
                          seed, step, row_start)
            elif kind == ROWWISE_ADAGRAD:
                if decay != 0:
                    for d in range(width):
                        g[d] = g[d] + decay * load(rows, r, d, code)
                squares = 0.0
                for d in range(width):
                    squares += np.float64(g[d]) * np.float64(g[d])
                total = np.float32(first[r, 0] + np.float32(squares / width))
                first[r, 0] = total
                scale = lr / (np.sqrt(total) + eps)
                for d in range(width):
                    store(rows, r, d, load(rows, r, d, code) - scale * g[d], code, stochastic,
                          seed, step, row_start)
            elif kind == ADAM:
                for d in range(width):
                    m_old, v_old = first[r, d], second[r, d]
                    m_change = (g[d] - m_old) * b1
                    v_change = (g[d] * g[d] - v_old) * b2
                    first[r, d] = m_old + m_change
                    second[r, d] = v_old + v_change
                    ratio = (m_change + m_old) / (np.sqrt(v_change + v_old) + eps)
                    store(rows, r, d, load(rows, r, d, code) + (-step_size) * ratio, code,
                          stochastic, seed, step, row_start)
            else:  # ROWWISE_ADAM
                sums, squares = 0.0, 0.0
                for d in range(width):
                    sums += np.float64(g[d])
                    squares += np.float64(g[d]) * np.float64(g[d])
                mean = np.float32(sums / width)
                mean_square = np.float32(squares / width)
                m = first[r, 0] + (mean - first[r, 0]) * b1
                v = second[r, 0] + (mean_square - second[r, 0]) * b2
                first[r, 0], second[r, 0] = m, v
                denom = np.sqrt(v) + eps
                for d in range(width):
                    change = step_size * (((g[d] - mean) + m) / denom)
                    store(rows, r, d, load(rows, r, d, code) - change, code, stochastic, seed,
                          step, row_start)
