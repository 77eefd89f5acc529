"""Small helpers several test modules share (defined once here; fixtures live in conftest.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np


def offset_array(shape, dtype, offset: int) -> np.ndarray:
    """A zeroed C-contiguous array starting ``offset`` bytes past a 64-byte boundary."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    backing = np.zeros(nbytes + 128, np.uint8)
    start = (-backing.ctypes.data) % 64 + offset
    return backing[start : start + nbytes].view(dtype).reshape(shape)


def every_pair_table(fmt) -> tuple[np.ndarray, np.ndarray]:
    """A block-scaled table whose row r holds every stored byte (all 256) under block scale
    byte r: every (block scale, stored byte) pair of ``fmt``, NaN scales and subnormals
    included."""
    weight = np.tile(np.arange(256, dtype=np.uint8), (256, 1))
    width = fmt.scale_width(weight.shape[1] * fmt.pack)
    scales = np.repeat(np.arange(256, dtype=np.uint8)[:, None], width, axis=1)
    return weight, scales


def run_cli(argv: list, capsys) -> tuple[int, str, str]:
    """Run the ``ngram-cupy`` command line in this process: (exit status, stdout, stderr);
    usage errors (argparse's ``SystemExit``) included."""
    from ngram_cupy.cli.main import main

    try:
        status = main([str(a) for a in argv])
    except SystemExit as exit:
        status = exit.code
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def pytest_script(prelude: str) -> str:
    """``python -c`` code: ``prelude``, then pytest on the arguments that follow, leaving with
    ``os._exit`` once its report is out: the teardown of an interpreter that imported torch, JAX
    or Ray takes seconds and checks nothing the run asks."""
    return (f"import os, sys, pytest\n{prelude}\ncode = pytest.main(sys.argv[1:])\n"
            "sys.stdout.flush()\nsys.stderr.flush()\nos._exit(int(code))")


def run_signal_worker(case: str, *args) -> dict | list:
    """Run a case of tests/signal_worker.py in a process of its own (its signals stay there);
    its JSON outcome."""
    tests = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests.parent), str(tests)])}
    run = subprocess.run([sys.executable, str(tests / "signal_worker.py"), case,
                          *map(str, args)], capture_output=True, text=True, env=env,
                         timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    return json.loads(run.stdout.splitlines()[-1])


def in_order_sum(values: np.ndarray) -> np.ndarray:
    """Row sums in float64 added left to right (NumPy's sum is pairwise)."""
    return np.cumsum(values.astype(np.float64), axis=1)[:, -1]


def gated(optimizer) -> threading.Event:
    """Hold every update of ``optimizer`` (a busy worker thread) until the returned event is
    set."""
    gate = threading.Event()
    apply = optimizer.apply

    def held(*args) -> None:
        gate.wait(10)
        apply(*args)

    optimizer.apply = held
    return gate
