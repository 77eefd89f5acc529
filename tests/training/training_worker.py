"""One Hogwild process of tests/training/test_table_rows.py (multiprocessing spawn): attach the
shared table, train it with RowwiseAdagrad on its own batches, report when done."""

from __future__ import annotations

import numpy as np


def train_shared(weight: np.ndarray, batches: list, ready, start, done) -> None:
    """Attach the table and the optimizer's shared state, set ``ready``, wait for ``start``,
    step on each ``(ids, grad_out)``, then set ``done`` (the segments stay while the parent
    holds them)."""
    import ngram_cupy as nc

    table = nc.EmbeddingTable(weight, placement="shared")
    optimizer = nc.RowwiseAdagrad(table, 0.1)
    ready.set()
    start.wait()
    for ids, grad in batches:
        optimizer.step_from_output_grad(ids, grad)
    done.set()
