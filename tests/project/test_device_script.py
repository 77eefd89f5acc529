"""scripts/device_check.sh: valid bash, and its dry run (the same flow on a CPU, GPU steps only
named) brings back at most 8 files, every step in the summary and every log in results.tgz."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "device_check.sh"
MAX_FILES = 8  # what the device tool brings back from $OUT
# The script runs ``python3``: here the tests' own interpreter (a venv's has the package's
# dependencies; the system's may not), as the device machine's python3 is there.
TEST_PYTHON_FIRST = os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])


def test_the_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """``(OUT folder, summary lines, log names)`` of one dry run."""
    out = tmp_path_factory.mktemp("out")
    env = {**os.environ, "OUT": str(out), "PATH": TEST_PYTHON_FIRST,
           "NGRAM_CUPY_CACHE_DIR": str(tmp_path_factory.mktemp("kernels"))}
    env.pop("CUDA_HOME", None)
    subprocess.run(["bash", str(SCRIPT), "--dry-run"], env=env, check=True, timeout=300,
                   capture_output=True)
    with tarfile.open(out / "results.tgz") as archive:
        logs = {Path(name).name for name in archive.getnames() if name.endswith(".txt")}
    return out, (out / "summary.txt").read_text().splitlines(), logs


def test_a_dry_run_keeps_to_eight_files_and_one_archive_of_logs(dry_run):
    out, summary, logs = dry_run
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= MAX_FILES and {p.name for p in files} >= {"summary.txt", "results.tgz"}
    steps = [line.split(":")[0] for line in summary[1:] if ": exit " in line]
    assert steps[:3] == ["versions", "compile", "gpu-tests-test_kernel_cache"]  # first things
    assert {"graph", "misaligned", "fresh-fill", "packed-uva", "jax-gpu", "bench",
            "sanitizer-memcheck"} <= set(steps)
    assert {f"{step}.txt" for step in steps} == logs
    assert summary[-1].startswith("total: ")


def test_the_dry_run_compiles_for_real_and_finds_cuda(dry_run):
    out, summary, _ = dry_run
    (compile_line,) = [line for line in summary if line.startswith("compile:")]
    assert "exit 0" in compile_line
    assert "CUDA_HOME=" in summary[0] and "dry run" in summary[0]


def test_no_step_starts_past_the_deadline(tmp_path):
    """A run whose budget is spent skips every step (the default budget, 420 s, stays under
    the device tool's 480 s)."""
    env = {**os.environ, "OUT": str(tmp_path), "DEVICE_CHECK_SECONDS": "4",
           "PATH": TEST_PYTHON_FIRST}
    subprocess.run(["bash", str(SCRIPT), "--dry-run"], env=env, check=True, timeout=60,
                   capture_output=True)
    summary = (tmp_path / "summary.txt").read_text().splitlines()
    assert "budget 4 s" in summary[0] and not [line for line in summary if ": exit " in line]
    assert [line for line in summary if line.startswith("compile: skipped")]
    assert 'deadline="${DEVICE_CHECK_SECONDS:-420}"' in SCRIPT.read_text()
