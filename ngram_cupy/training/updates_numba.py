"""CPU kernel of every row-wise update: each distinct row's gradient summed (float64, rounded
once), then the optimizer's formula in float32, the row written back (bfloat16: rounded to
nearest even, or stochastically from a counter-based hash: reproducible for any thread count).
The formula of one row (``update_row``) is inlined by this kernel and by ``updates_cuda``'s."""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from ..codecs.dequant import bits_to_float32, float32_to_bits
from ..formats import BFLOAT16, FLOAT32
from ..runtime.jitable import inline_jitable
from .float_ops import add, div, mul, sqrt, sub

SGD, ROWWISE_ADAGRAD, ADAM, ROWWISE_ADAM = 0, 1, 2, 3
# The row formats ``update_rows`` loads and stores (``load``, ``store``).
ROW_FORMATS = (FLOAT32, BFLOAT16)
# Hyper-parameters, float32, in this order: lr, eps, weight decay, 1 - beta1, 1 - beta2, step,
# the largest row norm after an update (0: none), 1 where weight decay is decoupled (else 0).
LR, EPS, DECAY, ONE_MINUS_BETA1, ONE_MINUS_BETA2, STEP_SIZE, MAX_NORM, DECOUPLED = range(8)
HYPER_SIZE = 8
BLOCK = 64
GOLDEN = np.uint64(0x9E3779B97F4A7C15)
MIX1 = np.uint64(0xBF58476D1CE4E5B9)
MIX2 = np.uint64(0x94D049BB133111EB)
LOW16 = np.uint32(0xFFFF)
HALF_MINUS_ONE = np.uint32(0x7FFF)
QUIET = np.uint32(0x40)
ONE = np.uint32(1)
SHIFT16 = np.uint32(16)


@inline_jitable
def noise16(seed, step, position):
    """16 random bits of (seed, step, position): splitmix64's finaliser of their mix."""
    z = np.uint64(seed) + np.uint64(step) * GOLDEN + np.uint64(position) * MIX2
    z = (z ^ (z >> np.uint64(30))) * MIX1
    z = (z ^ (z >> np.uint64(27))) * MIX2
    z = z ^ (z >> np.uint64(31))
    return np.uint32(z & np.uint64(0xFFFF))


@inline_jitable
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


@inline_jitable
def load(rows, r, d, code):
    """Row ``r``'s value ``d`` (float32 or bfloat16 bits, format ``code``) as float32."""
    if code == BFLOAT16:
        return bits_to_float32(np.uint32(rows[r, d]) << SHIFT16)
    return bits_to_float32(np.uint32(rows[r, d]))


@inline_jitable
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


@inline_jitable
def clamp_norm(g, max_norm):
    """Scale the new row ``g`` down to norm ``max_norm`` when its norm exceeds it: ``g *
    float32(max_norm / n)``, ``n`` the float32 norm (float64 squares in order, exact). A norm
    past float32's range is scaled in float64 (``float32(w * (max_norm / n64))``); a row holding
    infinities keeps its direction: each infinity becomes +-``max_norm / sqrt(count)`` and every
    finite value 0 (infinity times 0 would be NaN)."""
    width = g.shape[0]
    squares = 0.0
    infinite = 0
    for d in range(width):
        squares += np.float64(g[d]) * np.float64(g[d])
        if math.isinf(g[d]):
            infinite += 1
    norm = np.float32(math.sqrt(squares))
    if infinite:
        part = np.float32(max_norm / math.sqrt(infinite))
        for d in range(width):
            g[d] = math.copysign(part, g[d]) if math.isinf(g[d]) else np.float32(0.0)
    elif math.isinf(norm):  # the float64 product, rounded once (a float32 factor is subnormal)
        factor = max_norm / math.sqrt(squares)
        for d in range(width):
            g[d] = np.float32(np.float64(g[d]) * factor)
    elif norm > max_norm:
        factor = div(max_norm, norm)
        for d in range(width):
            g[d] = mul(g[d], factor)


@inline_jitable
def update_row(kind, rows, code, r, g, first, second, hyper, stochastic, seed, step, row_start):
    """Row ``r``'s update by optimizer ``kind`` from its summed gradient ``g`` (float32 ``[D]``,
    overwritten with the new row): the formula in float32, each operation rounded on its own
    (``float_ops``: the same bits on the CPU and a GPU), the row scaled down to
    ``hyper[MAX_NORM]`` when its norm exceeds it, then stored in the table's format."""
    width = g.shape[0]
    lr, eps, decay = hyper[LR], hyper[EPS], hyper[DECAY]
    b1, b2, step_size = hyper[ONE_MINUS_BETA1], hyper[ONE_MINUS_BETA2], hyper[STEP_SIZE]
    decoupled = hyper[DECOUPLED] != 0
    if kind == SGD or kind == ROWWISE_ADAGRAD:
        if decay != 0 and not decoupled:  # L2: the decay joins the gradient
            for d in range(width):
                g[d] = add(g[d], mul(decay, load(rows, r, d, code)))
        scale = lr
        if kind == ROWWISE_ADAGRAD:
            squares = 0.0
            for d in range(width):
                squares += np.float64(g[d]) * np.float64(g[d])
            total = add(first[r, 0], np.float32(squares / width))
            first[r, 0] = total
            scale = div(lr, add(sqrt(total), eps))
        keep = sub(np.float32(1.0), mul(lr, decay))  # decoupled: w = keep * w - scale * g
        for d in range(width):
            w = load(rows, r, d, code)
            if decoupled:
                w = mul(keep, w)
            g[d] = sub(w, mul(scale, g[d]))
    elif kind == ADAM:
        for d in range(width):
            m_old, v_old = first[r, d], second[r, d]
            m_change = mul(sub(g[d], m_old), b1)
            v_change = mul(sub(mul(g[d], g[d]), v_old), b2)
            first[r, d] = add(m_old, m_change)
            second[r, d] = add(v_old, v_change)
            ratio = div(add(m_change, m_old), add(sqrt(add(v_change, v_old)), eps))
            g[d] = add(load(rows, r, d, code), mul(-step_size, ratio))
    else:  # ROWWISE_ADAM
        sums, squares = 0.0, 0.0
        for d in range(width):
            sums += np.float64(g[d])
            squares += np.float64(g[d]) * np.float64(g[d])
        mean = np.float32(sums / width)
        mean_square = np.float32(squares / width)
        m = add(first[r, 0], mul(sub(mean, first[r, 0]), b1))
        v = add(second[r, 0], mul(sub(mean_square, second[r, 0]), b2))
        first[r, 0], second[r, 0] = m, v
        denom = add(sqrt(v), eps)
        for d in range(width):
            change = mul(step_size, div(add(sub(g[d], mean), m), denom))
            g[d] = sub(load(rows, r, d, code), change)
    if hyper[MAX_NORM] > 0:
        clamp_norm(g, hyper[MAX_NORM])
    for d in range(width):
        store(rows, r, d, g[d], code, stochastic, seed, step, row_start)


@njit(cache=True, nogil=True, parallel=True)
def update_rows(kind, rows, code, row_start, local, order, starts, grad, first, second, hyper,
                stochastic, seed, step):
    """Apply optimizer ``kind`` to local rows ``local[u]`` (global ``row_start + local[u]``),
    whose gradient is the float64 sum of ``grad[order[starts[u]:starts[u + 1]]]`` rounded to
    float32; state in ``first`` / ``second`` (float32 ``[rows, D]`` or ``[rows, 1]``)."""
    count, width = local.shape[0], grad.shape[1]
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
            update_row(kind, rows, code, r, g, first, second, hyper, stochastic, seed, step,
                       row_start)
