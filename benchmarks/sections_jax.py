"""JAX on the CPU: ``ngram_cupy.jax`` under ``jax.jit`` against the eager NumPy calls on the same
ids (lookups of an fp8 and a float32 table, a train step), and the per-call overhead."""

from __future__ import annotations

import ml_dtypes
import numpy as np

import ngram_cupy as nc

from .report import Row, Section
from .timers import paired

HEADS, DIM = 16, 160
TARGET = 1.3  # the most a jitted call may take, in eager NumPy times (issue 39)


def bench_jax_cpu(quick: bool) -> Section:
    """8,192 tokens x 16 heads x 160 dims on a 1 M-row table (quick: 256 K rows)."""
    try:
        import jax
    except ImportError:
        return Section("JAX: not measured, jax is not installed (pip install 'ngram-cupy[jax]')",
                       "cpu")
    import jax.numpy as jnp

    import ngram_cupy.jax as ncj

    tokens, rows = 8192, (1 << 18) if quick else (1 << 20)
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((rows, DIM), dtype=np.float32) * np.float32(0.01)
    ids = rng.integers(0, rows, (tokens, HEADS)).astype(np.int32)
    jax_ids = jnp.asarray(ids)
    section = Section(f"JAX, CPU: {tokens:,} tokens x {HEADS} heads x {DIM} dims, {rows:,}-row "
                      f"tables, jax {jax.__version__}", "cpu")
    rounds, min_time = (7, 2.0) if quick else (11, 4.0)

    def add(case: str, jitted, eager, what: str) -> None:
        mine, theirs, ratio = paired(jitted, eager, min_time=min_time, rounds=rounds)
        verdict = "within" if ratio <= TARGET else "over"
        section.rows.append(Row(case=case, seconds=mine, tokens=tokens,
                                notes=f"eager {what}: {theirs * 1e3:.2f} ms; {ratio:.2f}x "
                                      f"(paired median; {verdict} the {TARGET}x target)"))

    for name, table in (("fp8 -> bf16", nc.EmbeddingTable(weight.astype(
            ml_dtypes.float8_e4m3fn), scale=0.5)), ("float32", nc.EmbeddingTable(weight))):
        lookup = jax.jit(lambda i, table=table: ncj.lookup(table, i))
        add(f"jitted lookup, {name}", lambda lookup=lookup: lookup(jax_ids).block_until_ready(),
            lambda table=table: table.lookup(ids), "table.lookup")

    table = nc.EmbeddingTable(weight.copy())
    optimizer = nc.RowwiseAdagrad(table, lr=1e-4)

    @jax.jit
    def train_step(step_ids):
        rows = ncj.lookup(table, step_ids)
        return ncj.step_from_output_grad(optimizer, step_ids, rows * np.float32(1e-3))

    def numpy_step():
        optimizer.step_from_output_grad(ids, table.lookup(ids) * np.float32(1e-3))

    add("jitted train step (lookup, gradient, RowwiseAdagrad step)",
        lambda: train_step(jax_ids).block_until_ready(), numpy_step,
        "table.lookup + step_from_output_grad")

    one = ids[:1]
    jax_one = jnp.asarray(one)
    lookup = jax.jit(lambda i: ncj.lookup(table, i))
    for case, call in (("jitted", lambda: lookup(jax_one).block_until_ready()),
                       ("eager ncj.lookup", lambda: ncj.lookup(table, jax_one))):
        mine, theirs, _ = paired(call, lambda: table.lookup(one), min_time=1.0, rounds=rounds)
        section.rows.append(Row(case=f"per-call overhead, {case} (1 token x {HEADS} heads)",
                                seconds=mine, rate=f"+{(mine - theirs) * 1e6:.0f} us",
                                notes=f"eager NumPy table.lookup: {theirs * 1e6:.0f} us"))
    return section
