"""Threads: concurrent kernel calls are exact under every Numba threading layer, and never abort."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import threads_worker

from ngram_cupy.runtime import cpu_threads

WORKER = Path(__file__).with_name("threads_worker.py")


def test_four_threads_in_this_process_are_exact():
    # Also compiles the kernels into Numba's disk cache before the subprocesses below start.
    assert threads_worker.run_threads() == "exact"


@pytest.mark.parametrize("layer", ["tbb", "omp", "workqueue"])
def test_four_threads_calling_ids_and_gathers_are_exact(layer):
    env = {**os.environ, "NUMBA_THREADING_LAYER": layer}
    done = subprocess.run([sys.executable, str(WORKER)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = done.stdout.split()
    if result == ["unavailable"]:
        pytest.skip(f"Numba cannot load the {layer} threading layer here")
    assert result == [layer, "exact"], done.stdout + done.stderr[-2000:]


def test_tbb_from_the_pip_package_is_found_when_installed():
    path = cpu_threads.tbb_library_path()
    if path is None:
        pytest.skip("the tbb package is not installed")
    assert os.path.basename(path) == cpu_threads.TBB_LIBRARY
    assert cpu_threads.load_tbb()


def test_small_work_runs_serially_and_forced_work_in_parallel_under_tbb():
    with cpu_threads.use_threads(10, 1000) as threaded:
        assert not threaded
    if cpu_threads.threading_layer() == "tbb":
        with cpu_threads.use_threads(10, 0) as threaded:
            assert threaded


@pytest.mark.parametrize(("loadavg", "taken"), [
    ("0.10 0.20 0.30 1/300 4242", False),  # only the caller runs
    ("5.00 4.00 3.00 999/1200 4242", True),  # more runnable threads than any host's cores
    ("garbled", False),  # unreadable: assume free, as on hosts without /proc
])
def test_every_core_taken_makes_mid_sized_work_serial(tmp_path, monkeypatch, loadavg, taken):
    if cpu_threads.threading_layer() != "tbb":
        pytest.skip("the busy threshold applies under the tbb layer")
    stat = tmp_path / "loadavg"
    stat.write_text(loadavg)
    monkeypatch.setattr(cpu_threads, "RUNNABLE_FILE", str(stat))
    monkeypatch.setattr(cpu_threads, "_busy_reading", [-1.0, False])
    assert cpu_threads.cores_taken() is taken
    with cpu_threads.use_threads(100, 10, 1000) as threaded:
        assert threaded is not taken  # mid-sized: serial exactly when the cores are taken
    with cpu_threads.use_threads(5000, 10, 1000) as threaded:
        assert threaded  # large work repays a stall: threads even then
