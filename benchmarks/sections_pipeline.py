"""The overlapped training pipeline on a host table: per micro-step, lookup + fused backward and
RowwiseAdagrad step, synchronous against asynchronous with the next batch prefetched, against
the lookup alone (the same ids, paired)."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

import ngram_cupy as nc

from .report import Row, Section
from .sections_training import DIM, batch
from .timers import paired

MICRO_STEPS = 8  # micro-steps per timed call (the ids cycle through this many batches)


def pipeline(weight: np.ndarray, batches, mode: str) -> Callable[[], None]:
    """One timed call: ``MICRO_STEPS`` micro-steps on a table of its own; ``mode`` is "lookup"
    (the lookup alone), "sync" (lookup, then the step) or "overlap" (lookup, prefetch of the next
    batch, asynchronous step), all issued updates applied when it returns."""
    table = nc.EmbeddingTable(weight.copy())
    optimizer = nc.RowwiseAdagrad(table, 0.01, asynchronous=mode == "overlap")

    def run() -> None:
        for k, (ids, grad) in enumerate(batches):
            table.lookup(ids)
            if mode == "overlap":
                table.prefetch(batches[(k + 1) % len(batches)][0])
            if mode != "lookup":
                optimizer.step_from_output_grad(ids, grad)
        optimizer.synchronize()
        table.prefetcher.threads.wait()  # the last prefetch's gather, inside this call's time

    return run


def step_return_seconds(weight: np.ndarray, ids, grad) -> tuple[float, float]:
    """Median seconds for an asynchronous step to return, and for a synchronous one."""
    table = nc.EmbeddingTable(weight.copy())
    quick, slow = nc.RowwiseAdagrad(table, 0.01, asynchronous=True), None
    returns = []
    for _ in range(9):
        began = time.perf_counter()
        quick.step_from_output_grad(ids, grad)
        returns.append(time.perf_counter() - began)
        quick.synchronize()
    quick.close()
    slow = nc.RowwiseAdagrad(table, 0.01)
    full = []
    for _ in range(9):
        began = time.perf_counter()
        slow.step_from_output_grad(ids, grad)
        full.append(time.perf_counter() - began)
    return float(np.median(returns)), float(np.median(full))


def bench_train_pipeline(quick: bool) -> Section:
    """4,096 tokens x 16 heads x 160 dims per micro-step on a 262,144-row float32 table."""
    tokens, rows = (1024, 1 << 16) if quick else (4096, 1 << 18)
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((rows, DIM), dtype=np.float32) * np.float32(0.01)
    batches = [batch(rng, tokens, rows) for _ in range(MICRO_STEPS)]
    section = Section(f"training pipeline, CPU: {tokens:,} tokens x 16 heads x {DIM} dims per "
                      f"micro-step, {rows:,}-row float32 table, uniform ids, RowwiseAdagrad",
                      "cpu")
    alone = pipeline(weight, batches, "lookup")
    sync = pipeline(weight, batches, "sync")
    overlap = pipeline(weight, batches, "overlap")
    over, floor, ratio = paired(overlap, alone, min_time=6.0, rounds=9)
    section.rows.append(Row(case="lookup + step, overlapped (asynchronous, next batch "
                                 "prefetched)", seconds=over / MICRO_STEPS,
                            notes=f"lookup alone: {floor / MICRO_STEPS * 1e3:.2f} ms; "
                                  f"{ratio:.2f}x the lookup (paired median; target <= 1.15)"))
    plain, floor, ratio = paired(sync, alone, min_time=6.0, rounds=9)
    section.rows.append(Row(case="lookup + step, synchronous", seconds=plain / MICRO_STEPS,
                            notes=f"{ratio:.2f}x the lookup (paired median)"))
    over, plain, ratio = paired(overlap, sync, min_time=6.0, rounds=9)
    section.rows.append(Row(case="overlapped against synchronous", seconds=over / MICRO_STEPS,
                            notes=f"synchronous: {plain / MICRO_STEPS * 1e3:.2f} ms; "
                                  f"{ratio:.2f}x (paired median)"))
    returned, full = step_return_seconds(weight, *batches[0])
    section.rows.append(Row(case="an asynchronous step returns after", seconds=returned,
                            notes=f"a synchronous step: {full * 1e3:.2f} ms (the update "
                                  "kernels release the GIL: nogil=True)"))
    return section
