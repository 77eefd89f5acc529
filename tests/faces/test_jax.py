"""ngram_cupy.jax: ids, lookups and row training from JAX, eagerly and under jax.jit, give the
NumPy face's bits (skipped without jax)."""

from __future__ import annotations

import importlib
import re
import sys

import ml_dtypes
import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

from engram_cases import SHAPES, random_batch, small_layout  # noqa: E402

import ngram_cupy as nc  # noqa: E402
import ngram_cupy.jax as ncj  # noqa: E402

ROWS, DIM, HEADS = 1000, 32, 4


@pytest.fixture(scope="module")
def weight() -> np.ndarray:
    return np.random.default_rng(0).standard_normal((ROWS, DIM)).astype(np.float32)


@pytest.fixture(scope="module")
def tables(weight):
    """One table of each kind the face must serve, shared by the module's tests."""
    made = {
        "float32": nc.EmbeddingTable(weight),
        "bfloat16": nc.EmbeddingTable(weight.astype(ml_dtypes.bfloat16)),
        "fp8": nc.EmbeddingTable(weight.astype(ml_dtypes.float8_e4m3fn), scale=0.75),
        "nvfp4": nc.EmbeddingTable(nc.quantize_table(weight, "nvfp4")),
        "hot rows": nc.EmbeddingTable(weight, hot_rows=np.arange(0, ROWS, 7)),
        "shared": nc.EmbeddingTable(weight.astype(ml_dtypes.bfloat16), placement="shared"),
        "pinned": nc.EmbeddingTable(weight, placement="pinned"),  # host memory without a GPU
    }
    yield made
    for table in made.values():
        table.close()


@pytest.fixture(scope="module")
def ids() -> np.ndarray:
    return np.random.default_rng(1).integers(0, ROWS, (64, HEADS)).astype(np.int32)


def same_bits(got, want: np.ndarray) -> None:
    """``got`` (a JAX array) holds exactly ``want``'s dtype, shape and bits."""
    got = np.asarray(got)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


KINDS = ["float32", "bfloat16", "fp8", "nvfp4", "hot rows", "shared", "pinned"]


@pytest.mark.parametrize("kind", KINDS)
def test_lookup_eagerly_and_jitted_gives_the_numpy_bits(tables, ids, kind):
    table = tables[kind]
    want = table.lookup(ids)
    same_bits(ncj.lookup(table, jnp.asarray(ids)), want)
    same_bits(jax.jit(lambda i: ncj.lookup(table, i))(jnp.asarray(ids)), want)
    assert ncj.lookup_dtype(table) == want.dtype


@pytest.mark.parametrize("kind", ["fp8", "nvfp4"])
def test_out_dtype_is_the_tables(tables, ids, kind):
    table = tables[kind]
    want = table.lookup(ids, out_dtype=np.float32)
    jitted = jax.jit(lambda i: ncj.lookup(table, i, out_dtype="float32"))
    same_bits(jitted(jnp.asarray(ids)), want)
    same_bits(ncj.lookup(table, jnp.asarray(ids), out_dtype=np.float32), want)


def test_vmap_looks_up_each_batch(tables, ids):
    table = tables["bfloat16"]
    stacked = np.stack([ids, ids[::-1]])
    got = jax.jit(jax.vmap(lambda i: ncj.lookup(table, i)))(jnp.asarray(stacked))
    same_bits(got, np.stack([table.lookup(ids), table.lookup(ids[::-1])]))


def test_hot_rows_are_read_from_their_tier(tables, ids):
    table = tables["hot rows"]
    before = table.counters["hot_rows"]
    jax.jit(lambda i: ncj.lookup(table, i))(jnp.asarray(ids)).block_until_ready()
    assert table.counters["hot_rows"] - before == int((ids % 7 == 0).sum())


def test_ids_outside_the_table(tables):
    table = tables["float32"]
    bad = jnp.asarray(np.array([[1, 2, 3, ROWS + 5]], np.int32))
    with pytest.raises(IndexError, match=f"{ROWS + 5} is outside the table's rows"):
        ncj.lookup(table, bad)
    with pytest.raises(jax.errors.JaxRuntimeError, match=f"IndexError: .*{ROWS + 5} is outside"):
        jax.jit(lambda i: ncj.lookup(table, i))(bad).block_until_ready()


def test_bad_arguments_name_themselves(tables):
    table = tables["float32"]
    with pytest.raises(ValueError, match="ids must be 2-D"):
        ncj.lookup(table, jnp.zeros(4, jnp.int32))
    with pytest.raises(TypeError, match="ids must be an integer array"):
        ncj.lookup(table, jnp.zeros((4, 4)))
    with pytest.raises(TypeError, match="out_dtype must be float32"):
        ncj.lookup(table, jnp.zeros((4, 4), jnp.int32), out_dtype=np.int8)
    wrapped = np.full((4, 4), 2**32 + 5, np.int64)  # JAX's 32-bit mode would make it 5
    with pytest.raises(ValueError, match="ids holds int64 values outside int32"):
        ncj.lookup(table, wrapped)
    with pytest.raises(ValueError, match="ids holds int64 values outside int32"):
        ncj.step_from_output_grad(nc.SGD(table, lr=1.0), wrapped, np.zeros((4, 4 * DIM)))


@pytest.fixture(scope="module")
def layout():
    return nc.layer_layout(nc.NGramConfig(500, 3, 2, 300, 0), 0)


def test_ngram_ids_packed_and_rows(layout):
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, 500, 40).astype(np.int32)
    starts = np.array([0, 10, 10, 33, 40], np.int32)
    context = rng.integers(0, 500, (4, 2)).astype(np.int32)
    want = nc.compute_ngram_ids(layout, tokens, starts, context)
    args = [jnp.asarray(a) for a in (tokens, starts, context)]
    for got in (ncj.compute_ngram_ids(layout, *args),
                jax.jit(lambda *a: ncj.compute_ngram_ids(layout, *a))(*args)):
        assert got.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(got), want)
    rows = rng.integers(0, 500, (3, 7)).astype(np.int32)
    want = nc.compute_ngram_ids(layout, rows)
    got = jax.jit(lambda r: ncj.compute_ngram_ids(layout, r))(jnp.asarray(rows))
    assert got.shape == (3, 7, layout.num_heads)
    np.testing.assert_array_equal(np.asarray(got), want)


def test_ids_arguments_name_themselves(layout):
    with pytest.raises(ValueError, match="query_start_loc is required"):
        ncj.compute_ngram_ids(layout, jnp.arange(4))
    with pytest.raises(TypeError, match="input_ids must be an integer array"):
        ncj.compute_ngram_ids(layout, jnp.zeros((2, 3)))
    with pytest.raises(ValueError, match="offsets|query_start_loc"):  # the NumPy face's check
        ncj.compute_ngram_ids(layout, jnp.arange(4), jnp.array([0, 9]), jnp.zeros((1, 2), int))


def test_ngram_ids_are_int64_under_x64(layout):
    tokens = np.arange(12, dtype=np.int64)
    want = nc.compute_ngram_ids(layout, tokens, np.array([0, 12]), np.zeros((1, 2), np.int64))
    with jax.enable_x64(True):
        args = (jnp.asarray(tokens), jnp.asarray([0, 12]), jnp.zeros((1, 2), jnp.int64))
        got = jax.jit(lambda *a: ncj.compute_ngram_ids(layout, *a))(*args)
        assert got.dtype == jnp.int64
        np.testing.assert_array_equal(np.asarray(got), want)
        assert ncj.id_dtype(1 << 40) == np.int64
    with pytest.raises(ValueError, match="enable 64-bit ids"):
        ncj.id_dtype(1 << 31)


def test_engram_ids_eagerly_and_jitted():
    rng = np.random.default_rng(3)
    engram = small_layout(rng, SHAPES[1])
    batch = random_batch(rng, engram, 30, 4)
    want = nc.compute_engram_ids(engram, **batch)
    args = {name: jnp.asarray(value) for name, value in batch.items()}
    for got in (ncj.compute_engram_ids(engram, **args),
                jax.jit(lambda a: ncj.compute_engram_ids(engram, **a))(args)):
        assert got.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(got), want)
    bad = dict(args, input_ids=args["input_ids"].at[0].set(engram.vocab_size))
    with pytest.raises(ValueError, match="is not a token of the tokenizer"):
        ncj.compute_engram_ids(engram, **bad)


def loss(rows, params, target):
    """A small model over the looked-up rows: heads summed, a projection, squared error."""
    summed = rows.astype(jnp.float32).reshape(rows.shape[0], HEADS, DIM).sum(axis=1)
    return jnp.mean((summed @ params - target) ** 2)


GRAD = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


@pytest.mark.parametrize("dtype, make", [
    (np.float32, lambda table: nc.RowwiseAdagrad(table, lr=0.1)),
    (ml_dtypes.bfloat16, lambda table: nc.Adam(table, lr=0.01)),
])
def test_three_jitted_train_steps_leave_the_numpy_bits(weight, dtype, make):
    """lookup, value_and_grad of rows and params, the row update: one jitted function; three
    steps against the same sequence run with NumPy lookups and steps."""
    rng = np.random.default_rng(4)
    batches = [rng.integers(0, ROWS, (16, HEADS)).astype(np.int32) for _ in range(3)]
    target = jnp.asarray(rng.standard_normal((16, 8)).astype(np.float32))
    start = jnp.asarray(rng.standard_normal((DIM, 8)).astype(np.float32) * 0.1)
    table, reference = nc.EmbeddingTable(weight.astype(dtype)), nc.EmbeddingTable(
        weight.astype(dtype))
    optimizer, numpy_optimizer = make(table), make(reference)

    @jax.jit
    def train_step(params, ids):
        rows = ncj.lookup(table, ids)
        value, (grad_rows, grad_params) = jax.value_and_grad(loss, argnums=(0, 1))(
            rows, params, target)
        steps = ncj.step_from_output_grad(optimizer, ids, grad_rows)
        return params - 0.0625 * grad_params, value, steps  # 2**-4: FMA or not, same bits

    params, numpy_params = start, start
    for number, ids in enumerate(batches, 1):
        params, value, steps = train_step(params, jnp.asarray(ids))
        rows = reference.lookup(ids)
        numpy_value, (grad_rows, grad_params) = GRAD(rows, numpy_params, target)
        numpy_optimizer.step_from_output_grad(ids, np.asarray(grad_rows))
        numpy_params = numpy_params - 0.0625 * grad_params
        assert int(steps) == number
        assert float(value) == float(numpy_value)
    np.testing.assert_array_equal(table.host_view.view(np.uint8),
                                  reference.host_view.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(params), np.asarray(numpy_params))
    assert not np.array_equal(table.host_view, weight.astype(dtype))  # the rows did move


def test_eager_step_and_its_errors(weight):
    table = nc.EmbeddingTable(weight.copy())
    optimizer = nc.SGD(table, lr=0.5)
    ids = np.array([[3, 3], [7, 999]], np.int32)
    grad = np.ones((2, 2 * DIM), np.float32)
    assert int(ncj.step_from_output_grad(optimizer, jnp.asarray(ids), jnp.asarray(grad))) == 1
    np.testing.assert_array_equal(table.host_view[3], weight[3] - 1.0)
    with pytest.raises(IndexError, match="outside the table's rows"):
        ncj.step_from_output_grad(optimizer, jnp.asarray(ids + 1), jnp.asarray(grad))
    with pytest.raises(ValueError, match="NaN or inf|finite"):
        ncj.step_from_output_grad(optimizer, jnp.asarray(ids), jnp.full_like(grad, np.nan))
    assert optimizer.steps == 1  # refused steps change nothing


def test_an_eager_lookup_sees_the_updates_dispatched_before_it(weight):
    table, reference = nc.EmbeddingTable(weight.copy()), nc.EmbeddingTable(weight.copy())
    optimizer, numpy_optimizer = nc.SGD(table, lr=0.25), nc.SGD(reference, lr=0.25)
    ids = np.arange(0, 64, dtype=np.int32).reshape(16, 4)
    grad = np.full((16, 4 * DIM), 0.5, np.float32)
    step = jax.jit(lambda i, g: ncj.step_from_output_grad(optimizer, i, g))
    for _ in range(3):
        step(jnp.asarray(ids), jnp.asarray(grad))  # dispatched, not waited for
        numpy_optimizer.step_from_output_grad(ids, grad)
    same_bits(ncj.lookup(table, jnp.asarray(ids)), reference.lookup(ids))


@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
def test_asynchronous_steps_copy_the_gradient_and_count_after_the_step(weight, jitted):
    """An asynchronous optimizer's worker applies a step after the call returns, when XLA has
    reused the gradient's buffer: the rows equal a synchronous NumPy run's bit for bit, no
    finite step is refused, and each call returns the count after its step (1, 2, 3...)."""
    rng = np.random.default_rng(5)
    batches = [rng.integers(0, ROWS, (16, HEADS)).astype(np.int32) for _ in range(4)]
    target = jnp.asarray(rng.standard_normal((16, 8)).astype(np.float32))
    params = jnp.asarray(rng.standard_normal((DIM, 8)).astype(np.float32) * 0.1)
    table, reference = nc.EmbeddingTable(weight.copy()), nc.EmbeddingTable(weight.copy())
    optimizer = nc.RowwiseAdagrad(table, lr=0.1, asynchronous=True)
    numpy_optimizer = nc.RowwiseAdagrad(reference, lr=0.1)

    def train_step(ids):
        grad_rows = GRAD(ncj.lookup(table, ids), params, target)[1][0]
        return ncj.step_from_output_grad(optimizer, ids, grad_rows)

    step = jax.jit(train_step) if jitted else train_step
    for number, ids in enumerate(batches, 1):
        assert int(step(jnp.asarray(ids))) == number
        jnp.zeros((16, HEADS * DIM)).block_until_ready()  # XLA reuses the freed buffers
        grad_rows = GRAD(reference.lookup(ids), params, target)[1][0]
        numpy_optimizer.step_from_output_grad(ids, np.asarray(grad_rows))
    optimizer.synchronize()
    assert optimizer.steps == len(batches)
    np.testing.assert_array_equal(table.host_view, reference.host_view)
    optimizer.close()


def test_without_jax_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "jax", None)
    monkeypatch.delitem(sys.modules, "ngram_cupy.jax")
    with pytest.raises(ImportError, match=re.escape("needs jax: pip install -e '.[jax]' in a "
                                                    "clone")):
        importlib.import_module("ngram_cupy.jax")
