"""One rank of tests/distributed/test_hostile_ranks.py: a sequence of data-parallel and
tensor-parallel Adam steps, some refused on one rank (another dtype, NaN in a term another rank
owns, no ids, float64 gradients, an id outside the table, ids of None: torch's RuntimeError).

Usage: python dist_hostile_worker.py JOB_DIR RANK. ``JOB_DIR/job.json`` names the checkpoint,
config, rendezvous address and the steps (``[mode, dtype of rank 0, dtype of rank 1]``);
``JOB_DIR/inputs.npz`` each step's ids and gradients per rank. Writes ``JOB_DIR/out_RANK.npz``:
the rows of each mode, the step counts and each step's outcome on this rank.
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import ngram_cupy as nc


def gradient(values: np.ndarray, dtype: str):
    """The gradient as the rank passes it: float32 / float64 NumPy, or bfloat16 torch."""
    if dtype == "bf16":
        return torch.from_numpy(values).to(torch.bfloat16)
    return values.astype(np.float64 if dtype == "f64" else np.float32)


def main(job_dir: Path, rank: int) -> None:
    job = json.loads((job_dir / "job.json").read_text())
    inputs = dict(np.load(job_dir / "inputs.npz"))
    dist.init_process_group("gloo", init_method=job["init_method"], rank=rank,
                            world_size=job["world_size"],
                            timeout=datetime.timedelta(seconds=job["timeout_s"]))
    config = nc.NGramConfig(**job["config"])
    trainers = {}
    for mode in ("dp", "tp"):
        embedding = nc.load_ngram_embedding(job["checkpoint"], config, 0, placement="cpu",
                                            rank=rank, world_size=job["world_size"])
        lookup = nc.ShardedLookup(embedding, dp_group=dist.group.WORLD if mode == "dp" else None)
        trainers[mode] = nc.ShardedOptimizer(lookup, nc.Adam(embedding.table, lr=job["lr"]))
    outcomes = []
    for step, (mode, *dtypes) in enumerate(job["steps"]):
        key = f"{step}_{rank}" if mode == "dp" else f"{step}"
        try:
            ids = None if dtypes[rank] == "none" else inputs[f"ids_{key}"]
            trainers[mode].step_from_output_grad(
                ids, gradient(inputs[f"grad_{key}"], dtypes[rank]))
            outcomes.append("ok")
        except (TypeError, ValueError, IndexError, RuntimeError) as error:
            outcomes.append(f"{type(error).__name__}: {error}")
    np.savez(job_dir / f"out_{rank}.npz", outcomes=np.array(outcomes),
             steps=np.array([trainers[mode].optimizer.steps for mode in ("dp", "tp")]),
             **{mode: trainer.table.host_view.copy() for mode, trainer in trainers.items()})
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
