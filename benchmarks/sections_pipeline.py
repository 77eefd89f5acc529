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


def dense_work(seconds: float) -> Callable[[], None]:
    """Dense compute as a model's layers run it (torch matmuls on one thread, which release the
    GIL), lasting about ``seconds`` alone."""
    import torch

    left, right = torch.ones((256, 256)), torch.ones((256, 256))
    began = time.perf_counter()
    for _ in range(10):
        torch.mm(left, right)
    rounds = max(1, int(10 * seconds / (time.perf_counter() - began)))

    def work() -> None:
        for _ in range(rounds):
            torch.mm(left, right)

    return work


def beside_dense(weight: np.ndarray, ids, grad) -> tuple[float, float, float]:
    """Median seconds of: an asynchronous step with dense work in the caller's thread until it
    is applied; the dense work alone; a synchronous step alone."""
    table = nc.EmbeddingTable(weight.copy())
    quick, slow = nc.RowwiseAdagrad(table, 0.01, asynchronous=True), nc.RowwiseAdagrad(table,
                                                                                       0.01)
    slow.step_from_output_grad(ids, grad)
    began = time.perf_counter()
    slow.step_from_output_grad(ids, grad)
    work = dense_work(time.perf_counter() - began)
    both, alone, step = [], [], []
    for _ in range(7):
        began = time.perf_counter()
        quick.step_from_output_grad(ids, grad)
        work()
        quick.synchronize()
        both.append(time.perf_counter() - began)
        began = time.perf_counter()
        work()
        alone.append(time.perf_counter() - began)
        began = time.perf_counter()
        slow.step_from_output_grad(ids, grad)
        step.append(time.perf_counter() - began)
    quick.close()
    return float(np.median(both)), float(np.median(alone)), float(np.median(step))


def caller_pauses(weight: np.ndarray, ids, grad) -> tuple[float, int, float]:
    """While asynchronous steps run, the caller's thread spins in a Python loop: the median
    step time, the loop's rounds and its longest pause (a kernel holding the GIL would pause it
    for the whole kernel)."""
    table = nc.EmbeddingTable(weight.copy())
    optimizer = nc.RowwiseAdagrad(table, 0.01, asynchronous=True)
    optimizer.step_from_output_grad(ids, grad)
    optimizer.synchronize()
    steps, rounds, pauses = [], [], []
    for _ in range(5):
        began = last = time.perf_counter()
        optimizer.step_from_output_grad(ids, grad)
        count, pause = 0, 0.0
        while optimizer.worker.busy:
            now = time.perf_counter()
            pause, last, count = max(pause, now - last), now, count + 1
        optimizer.synchronize()
        steps.append(time.perf_counter() - began)
        rounds.append(count)
        pauses.append(pause)
    optimizer.close()
    return float(np.median(steps)), int(np.median(rounds)), float(np.median(pauses))


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
                            notes=f"a synchronous step: {full * 1e3:.2f} ms"))
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        both, dense, step = beside_dense(weight, *batches[0])
    finally:
        torch.set_num_threads(threads)
    section.rows.append(Row(case="asynchronous step beside dense torch work in the caller",
                            seconds=both,
                            notes=f"the torch work alone (1 thread): {dense * 1e3:.2f} ms, a "
                                  f"synchronous step alone: {step * 1e3:.2f} ms; both in "
                                  f"{both / (dense + step):.2f}x their sum (1.0: no overlap)"))
    step, rounds, pause = caller_pauses(weight, *batches[0])
    section.rows.append(Row(case="the caller's thread during an asynchronous step",
                            seconds=step,
                            notes=f"a Python loop ran {rounds:,} rounds meanwhile, its longest "
                                  f"pause {pause * 1e3:.1f} ms (median of 5 steps): the update "
                                  "kernels leave the GIL to the caller"))
    return section
