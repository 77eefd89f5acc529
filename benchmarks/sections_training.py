"""Training on the CPU: backward + RowwiseAdagrad step against torch's sparse embedding gradient
(coalesce + SparseAdam) and the forward gather of the same rows; state bytes per row; shared
Hogwild training in two processes against one."""

from __future__ import annotations

import multiprocessing
import time

import numpy as np

import ngram_cupy as nc

from .report import Row, Section
from .timers import paired

HEADS, DIM = 16, 160


def batch(rng, tokens: int, rows: int):
    """Uniform ids ``[tokens, 16]`` and a float32 output gradient ``[tokens, 16 * 160]``."""
    ids = rng.integers(0, rows, (tokens, HEADS))
    return ids, rng.standard_normal((tokens, HEADS * DIM), dtype=np.float32)


def hogwild_worker(weight_rows: int, steps: int, part: int, start, done) -> None:
    """One Hogwild process: ``steps`` fused RowwiseAdagrad steps on its own half of the rows."""
    import numba

    numba.set_num_threads(1)
    rng = np.random.default_rng(part)
    table = nc.EmbeddingTable(np.zeros((weight_rows, DIM), np.float32), placement="shared")
    optimizer = nc.RowwiseAdagrad(table, 0.01)
    half = weight_rows // 2
    ids, grad = batch(rng, 4096, half)
    optimizer.step_from_output_grad(ids + part * half, grad)  # compiled before the clock
    start.wait()
    began = time.perf_counter()
    for _ in range(steps):
        optimizer.step_from_output_grad(ids + part * half, grad)
    done.put(time.perf_counter() - began)
    optimizer.close()
    table.close()


def hogwild_seconds(processes: int, rows: int, steps: int) -> float:
    """Wall seconds for ``processes`` processes to run ``steps`` steps each on one shared table."""
    spawn = multiprocessing.get_context("spawn")
    holder = nc.EmbeddingTable(np.zeros((rows, DIM), np.float32), placement="shared")
    start, done = spawn.Event(), spawn.Queue()
    workers = [spawn.Process(target=hogwild_worker, args=(rows, steps, part, start, done))
               for part in range(processes)]
    for worker in workers:
        worker.start()
    time.sleep(8.0)  # every worker attached and compiled
    start.set()
    seconds = max(done.get(timeout=600) for _ in workers)
    for worker in workers:
        worker.join(60)
    holder.close()
    return seconds


def bench_train_cpu(quick: bool) -> Section:
    """65,536 tokens x 16 heads x 160 dims on a 4 M-row float32 table (quick: 16,384 / 1 M)."""
    import torch

    tokens, rows = (16_384, 1 << 20) if quick else (65_536, 1 << 22)
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((rows, DIM), dtype=np.float32) * np.float32(0.01)
    table = nc.EmbeddingTable(weight)
    ids, grad = batch(rng, tokens, rows)
    section = Section(f"training, CPU: {tokens:,} tokens x {HEADS} heads x {DIM} dims, "
                      f"{rows:,}-row float32 table", "cpu")
    adagrad = nc.RowwiseAdagrad(table, 0.01)
    param = torch.nn.Parameter(torch.from_numpy(weight))  # the same rows: only timing matters
    sparse_adam = torch.optim.SparseAdam([param], lr=0.01)
    torch_ids, torch_grad = torch.from_numpy(ids.reshape(-1)), torch.from_numpy(grad)

    def ours():
        adagrad.step_from_output_grad(ids, grad)

    def torch_step():
        # what F.embedding(sparse=True)'s backward yields: one COO row per id, uncoalesced
        param.grad = torch.sparse_coo_tensor(torch_ids[None], torch_grad.view(-1, DIM),
                                             (rows, DIM))
        sparse_adam.step()  # coalesces, then updates

    def gather():
        table.lookup(ids)

    mine, theirs, ratio = paired(ours, torch_step, min_time=4.0, rounds=5)
    section.rows.append(Row(case="backward + RowwiseAdagrad step (fused)", seconds=mine,
                            notes=f"torch COO grad + coalesce + SparseAdam step: {theirs:.3f} s; "
                                  f"{1 / ratio:.2f}x faster (paired median)", tokens=0))
    mine, floor, ratio = paired(ours, gather, min_time=4.0, rounds=5)
    section.rows.append(Row(case="the same step against the forward gather", seconds=mine,
                            notes=f"gather of the same ids: {floor:.3f} s; step = {ratio:.2f}x "
                                  "the gather (paired median)"))
    for name, optimizer in (("RowwiseAdagrad", adagrad),
                            ("Adam rowwise", nc.Adam(nc.EmbeddingTable(weight[:8]), rowwise=True)),
                            ("Adam (SparseAdam)", nc.Adam(nc.EmbeddingTable(weight[:8])))):
        section.rows.append(Row(case=f"state bytes per row: {name}", seconds=0.0,
                                rate=f"{optimizer.state_bytes_per_row} B/row"))
    hog_rows, steps = 1 << 18, 10 if quick else 30
    one = hogwild_seconds(1, hog_rows, steps)
    two = hogwild_seconds(2, hog_rows, steps)
    section.rows.append(Row(case=f"shared Hogwild, 2 processes x {steps} steps (4,096 tokens, "
                                 f"{hog_rows:,} rows, 1 thread each)", seconds=two / steps,
                            rate=f"{2 * steps / two:.1f} steps/s",
                            notes=f"1 process: {steps / one:.1f} steps/s; "
                                  f"{(2 * steps / two) / (steps / one):.2f}x"))
    return section
