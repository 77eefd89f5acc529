"""Real torch.distributed ranks for the sharding tests: one worker process per rank on this
machine (Gloo over loopback), each reading ``JOB_DIR/job.json`` and writing ``out_RANK.npz``."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

TIMEOUT_S = 120  # a hung collective fails the test instead of blocking CI


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_method() -> str:
    """A TCP rendezvous address on loopback for a new group."""
    return f"tcp://127.0.0.1:{free_port()}"


def run_ranks(worker: Path, job_dir: Path, world: int, **env: str) -> list[dict]:
    """Start ``world`` ranks of ``worker`` on ``job_dir``, wait for all (at most ``TIMEOUT_S``),
    fail with a rank's log if it failed, and return every rank's outputs in rank order."""
    env = {**os.environ, "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"), **env}
    procs = [subprocess.Popen([sys.executable, str(worker), str(job_dir), str(rank)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(world)]
    try:
        logs = [p.communicate(timeout=TIMEOUT_S)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for rank, (p, log) in enumerate(zip(procs, logs, strict=True)):
        assert p.returncode == 0, f"rank {rank} failed:\n{log}"
    return [dict(np.load(job_dir / f"out_{rank}.npz")) for rank in range(world)]
