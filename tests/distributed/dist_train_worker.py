"""One rank of the row-sharded training tests (started by
tests/distributed/test_distributed_training.py).

Usage: python dist_train_worker.py JOB_DIR RANK. ``JOB_DIR/job.json`` names the checkpoint,
config, rendezvous address and learning rate; ``JOB_DIR/inputs.npz`` the steps' ids and targets.
Each mode (tensor and data parallel) trains a fresh shard; its rows go to ``JOB_DIR/out_RANK.npz``.
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

import numpy as np
import torch.distributed as dist

import ngram_cupy as nc


def main(job_dir: Path, rank: int) -> None:
    job = json.loads((job_dir / "job.json").read_text())
    inputs = dict(np.load(job_dir / "inputs.npz"))
    world = job["world_size"]
    dist.init_process_group("gloo", init_method=job["init_method"], rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=job["timeout_s"]))
    config = nc.NGramConfig(**job["config"])
    results = {}
    for mode in ("tp", "dp"):
        embedding = nc.load_ngram_embedding(job["checkpoint"], config, 0, placement="cpu",
                                            rank=rank, world_size=world)
        lookup = nc.ShardedLookup(embedding, dp_group=dist.group.WORLD if mode == "dp" else None)
        trainer = nc.ShardedOptimizer(lookup, nc.RowwiseAdagrad(embedding.table, lr=job["lr"]))
        for step in range(job["steps"]):
            key = f"{step}" if mode == "tp" else f"{step}_{rank}"
            ids, target = inputs[f"ids_{key}"], inputs[f"target_{key}"]
            rows = lookup.lookup(ids)
            trainer.step_from_output_grad(ids, rows - target)  # of 0.5 * |rows - target|^2
        results[mode] = embedding.table.host_view.copy()
    np.savez(job_dir / f"out_{rank}.npz", **results)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
