"""The GPU update kernel: in the CUDA simulator it gives the CPU kernel's bits for every
optimizer, row format and rule; compiled, it fuses no multiply with an add."""

from __future__ import annotations

import re

import kernel_builds
import ml_dtypes
import numpy as np
import pytest

from ngram_cupy.formats import BFLOAT16, FLOAT32
from ngram_cupy.runtime.cuda_launch import check_abi
from ngram_cupy.runtime.jitable import read_only
from ngram_cupy.training import backward_numba, updates_cuda, updates_numba
from ngram_cupy.training.optimizers import hyper_array

ROWS, DIM = 12, 5
KINDS = {"sgd": updates_numba.SGD, "rowwise_adagrad": updates_numba.ROWWISE_ADAGRAD,
         "adam": updates_numba.ADAM, "rowwise_adam": updates_numba.ROWWISE_ADAM}


def setup(kind, dtype, seed=0):
    """Raw rows, state arrays, and one batch's (local rows, order, starts, gradient terms)."""
    rng = np.random.default_rng(seed)
    weight = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    rows = weight.astype(dtype).view(np.uint32 if dtype == np.float32 else np.uint16)
    width = DIM if kind == updates_numba.ADAM else 1
    states = [np.abs(rng.standard_normal((ROWS, width))).astype(np.float32) for _ in range(2)]
    if kind in (updates_numba.SGD, updates_numba.ROWWISE_ADAGRAD):
        states[1] = np.zeros((0, 1), np.float32)
    if kind == updates_numba.SGD:
        states[0] = np.zeros((0, 1), np.float32)
    ids = rng.integers(0, ROWS, 20)
    grad = rng.standard_normal((20, DIM)).astype(np.float32)
    order, local, starts = backward_numba.sorted_order(ids, 0, ROWS)
    return rows, states, (local, order, starts, grad)


def cpu_update(kind, code, rows, states, batch, hyper, stochastic):
    local, order, starts, grad = batch
    updates_numba.update_rows(kind, rows, code, 0, local, order, starts, read_only(grad),
                              states[0], states[1], hyper, stochastic, np.uint64(7),
                              np.uint64(3))  # read-only grads, as the optimizers pass them


def gpu_update(kind, code, rows, states, batch, hyper, stochastic):
    """The simulated kernel on the summed gradients (the backward kernel's bits, tested
    beside it)."""
    local, order, starts, grad = batch
    values = np.empty((local.shape[0], DIM), np.float32)
    backward_numba.segment_sums(grad, order, starts, values)
    updates_cuda.launch_update_rows(kind, rows, code, local, values, states[0], states[1],
                                    hyper, stochastic, 7, 3)


RULES = {"plain": {}, "l2": {"decay": 0.3}, "decoupled": {"decay": 0.3, "decoupled": True},
         "max_norm": {"decay": 0.3, "max_norm": 1.0}}
# weight decay is a rule of SGD and row-wise Adagrad; the max-norm clamp applies to every kind
CASES = [(name, rule) for name in KINDS for rule in RULES
         if name in ("sgd", "rowwise_adagrad") or rule in ("plain", "max_norm")]


@pytest.mark.parametrize(("name", "rule"), CASES)
@pytest.mark.parametrize(("dtype", "code", "stochastic"),
                         [(np.float32, FLOAT32, False), (ml_dtypes.bfloat16, BFLOAT16, True)])
def test_simulated_kernel_gives_the_cpu_bits(simulate, name, rule, dtype, code, stochastic):
    kind = KINDS[name]
    hyper = hyper_array(0.1, 1e-6, adam=(0.1, 0.01, 0.05), **RULES[rule])
    results = []
    for update in (cpu_update, gpu_update):
        rows, states, batch = setup(kind, dtype)
        update(kind, code, rows, states, batch, hyper, stochastic)
        results.append((rows, states))
    (cpu_rows, cpu_states), (gpu_rows, gpu_states) = results
    assert gpu_rows.tobytes() == cpu_rows.tobytes()
    assert all(a.tobytes() == b.tobytes() for a, b in zip(gpu_states, cpu_states, strict=True))
    assert cpu_rows.tobytes() != setup(kind, dtype)[0].tobytes()  # the rows did change


@pytest.mark.parametrize("raw", [np.uint32, np.uint16])
def test_compiled_kernel_rounds_every_float32_operation(raw):
    """ptxas may fuse a multiply and an add written without a rounding mode (``mul.f32``) into
    one FMA; every float32 operation of the kernel carries ``.rn``, which it never fuses."""
    args = (np.int64(1), np.zeros((4, 3), raw), np.int64(0), np.zeros(2, np.int64),
            np.zeros((2, 3), np.float32), np.zeros((4, 1), np.float32),
            np.zeros((4, 1), np.float32), np.zeros(8, np.float32), np.bool_(False),
            np.uint64(1), np.uint64(1), np.int64(0))
    ptx = kernel_builds.build_for(updates_cuda.update_rows_kernel, args).ptx
    check_abi(ptx, args, "update_rows")
    operations = re.findall(r"\b((?:add|sub|mul|div|fma|sqrt)(?:\.\w+)*\.f32)\b", ptx)
    assert {"mul.rn.f32", "sub.rn.f32", "div.rn.f32", "sqrt.rn.f32"} <= set(operations)
    assert all(".rn." in op and not op.startswith("fma") for op in operations), operations


def test_a_gpu_step_passes_each_launch_parameter_its_value(simulate, monkeypatch):
    """``gpu_steps.apply`` (a ``placement="gpu"`` table's optimizer step) through the real
    launcher, with the fake CuPy's arrays on the host and the kernel simulated: each kernel
    parameter receives its value (``row_start`` the shard's first global row, ``stream`` the
    step's stream), and a sharded bfloat16 table rounds stochastically as the whole table does
    (the noise hashes the global row, not the local one)."""
    import inspect
    import types as pytypes

    from fake_cupy import FakeCupy

    import ngram_cupy as nc
    from ngram_cupy.runtime import backends
    from ngram_cupy.training import gpu_steps

    cupy = FakeCupy()
    cupy.empty, cupy.asarray, cupy.ndarray = np.empty, np.asarray, pytypes.SimpleNamespace
    monkeypatch.setattr(backends, "cupy_module", lambda: cupy)
    launches = []
    real = updates_cuda.update_rows_kernel

    def recorded(grid, block, args, stream):
        launches.append((args, stream))
        real(grid, block, args, stream)

    monkeypatch.setattr(updates_cuda, "update_rows_kernel", recorded)
    start, rng = 4, np.random.default_rng(11)
    weight = rng.standard_normal((ROWS, DIM)).astype(ml_dtypes.bfloat16)
    rows = np.array([4, 6, 7, 11])
    grads = rng.standard_normal((rows.size, DIM)).astype(np.float32)

    def stepped(table, indices):
        return nc.SGD(table, lr=0.1, stochastic_rounding=True, seed=7), indices

    whole, _ = stepped(nc.EmbeddingTable(weight.copy()), rows)
    whole.step(nc.SparseRows(rows, grads.copy()))
    shard = nc.EmbeddingTable(weight[start:].copy(), row_start=start, total_rows=ROWS)
    optimizer, local = stepped(shard, rows - start)
    stream = cupy.cuda.get_current_stream()
    gpu_steps.apply(optimizer, local, grads.copy(), stream)
    (args, launched_on), = launches
    received = dict(zip(inspect.signature(real.py_func).parameters, args, strict=True))
    assert launched_on is stream and optimizer.steps == 1
    assert received["row_start"] == start and received["step"] == 1 and received["seed"] == 7
    assert received["stochastic"] and received["kind"] == updates_numba.SGD
    assert received["rows"] is optimizer.rows and received["code"] == BFLOAT16
    np.testing.assert_array_equal(received["local"], local)
    assert shard.host_view.tobytes() == whole.table.host_view[start:].tobytes()
    local_only = nc.EmbeddingTable(weight[start:].copy())  # the noise of local rows differs
    nc.SGD(local_only, lr=0.1, stochastic_rounding=True, seed=7).step(
        nc.SparseRows(rows - start, grads.copy()))
    assert local_only.host_view.tobytes() != shard.host_view.tobytes()
