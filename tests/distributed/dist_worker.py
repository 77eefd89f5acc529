"""One rank of the multi-process sharding tests (launched by tests/distributed/test_distributed.py).

Usage: python dist_worker.py JOB_DIR RANK. ``JOB_DIR/job.json`` names the checkpoint, config,
backend, rendezvous address and placements; ``JOB_DIR/inputs.npz`` holds the shared ids and each
rank's own batch. Results (as float32) go to ``JOB_DIR/out_RANK.npz``.
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import torch.distributed as dist

import ngram_cupy as nc


def main(job_dir: Path, rank: int) -> None:
    job = json.loads((job_dir / "job.json").read_text())
    inputs = dict(np.load(job_dir / "inputs.npz"))
    world = job["world_size"]
    gpu = job["backend"] == "nccl"
    if gpu:
        import cupy
        import torch

        torch.cuda.set_device(rank)
        cupy.cuda.Device(rank).use()
    dist.init_process_group(
        job["backend"], init_method=job["init_method"], rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=job["timeout_s"]),
    )
    config = nc.NGramConfig(**job["config"])
    mine = {name[: -len(f"_{rank}")]: a for name, a in inputs.items() if name.endswith(f"_{rank}")}
    if gpu:
        mine = {name: cupy.asarray(a) for name, a in mine.items()}
        inputs["ids"] = cupy.asarray(inputs["ids"])
    results = {}
    for placement in job["placements"]:
        embedding = nc.load_ngram_embedding(
            job["checkpoint"], config, job["layer"], placement=placement, rank=rank,
            world_size=world,
        )
        tensor_parallel = nc.ShardedLookup(embedding)
        data_parallel = nc.ShardedLookup(embedding, dp_group=dist.group.WORLD)
        counts = [int(inputs[f"ids_{r}"].shape[0]) for r in range(world)]
        outputs = {
            "etp": tensor_parallel.lookup(inputs["ids"]),
            "dp": data_parallel.lookup(mine["ids"]),
            "dp_counts_given": data_parallel.lookup(mine["ids"], num_tokens_across_dp=counts),
            "forward": data_parallel(mine["tokens"], mine["starts"], mine["context"]),
        }
        for name, out in outputs.items():
            out = out.get() if gpu else out
            if out.dtype == np.uint16:  # bfloat16 bits: CuPy has no bfloat16
                out = out.view(ml_dtypes.bfloat16)
            results[f"{name}_{placement}"] = out.astype(np.float32)
    np.savez(job_dir / f"out_{rank}.npz", **results)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
