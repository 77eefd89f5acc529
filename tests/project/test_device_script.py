"""scripts/device_check.sh: valid bash, and its dry run (the same flow on a CPU, GPU steps only
named) brings back at most 8 files, every step in the summary and every log in results.tgz, its
time boxes within the deadline and every GPU test file in its one pytest run."""

from __future__ import annotations

import os
import re
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
    """``(OUT folder, summary lines, logs by name, folders CUDA_HOME must not be)`` of one dry
    run, given a CUDA_HOME without NVVM and an ``nvcc`` wrapper outside any toolkit first on
    the PATH (as on the GPU machine's image)."""
    out = tmp_path_factory.mktemp("out")
    no_nvvm = tmp_path_factory.mktemp("cuda_home")
    wrapper = tmp_path_factory.mktemp("wrapper")
    (wrapper / "bin").mkdir()
    nvcc = wrapper / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\nexec /usr/local/cuda/bin/nvcc \"$@\"\n")
    nvcc.chmod(0o755)
    env = {**os.environ, "OUT": str(out), "CUDA_HOME": str(no_nvvm),
           "PATH": os.pathsep.join([str(wrapper / "bin"), TEST_PYTHON_FIRST]),
           "NGRAM_CUPY_CACHE_DIR": str(tmp_path_factory.mktemp("kernels"))}
    subprocess.run(["bash", str(SCRIPT), "--dry-run"], env=env, check=True, timeout=300,
                   capture_output=True)
    with tarfile.open(out / "results.tgz") as archive:
        logs = {Path(member.name).stem: archive.extractfile(member).read().decode()
                for member in archive.getmembers() if member.name.endswith(".txt")}
    return out, (out / "summary.txt").read_text().splitlines(), logs, (no_nvvm, wrapper)


def test_a_dry_run_keeps_to_eight_files_and_one_archive_of_logs(dry_run):
    out, summary, logs, _ = dry_run
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= MAX_FILES and {p.name for p in files} >= {"summary.txt", "results.tgz"}
    steps = [line.split(":")[0] for line in summary if ": exit " in line]
    assert steps[:3] == ["versions", "compile", "gpu-tests"]  # first things
    assert {"graph", "misaligned", "fresh-fill", "torch-graphs", "train", "packed-uva",
            "jax-gpu", "bench", "memcheck"} <= set(steps)
    assert set(steps) == set(logs)
    assert summary[-1].startswith("total: ")


def test_the_plan_fits_the_deadline(dry_run):
    """The time boxes add up to at most the deadline, which leaves the device tool's 600 s
    command limit a margin."""
    _, summary, _, _ = dry_run
    (plan,) = [line for line in summary if line.startswith("plan: ")]
    planned, deadline = map(int, re.fullmatch(
        r"plan: (\d+) s of time boxes for a (\d+) s deadline", plan).groups())
    boxes = [int(line.split()[1]) for line in summary if re.match(r"  \S+ +\d+ s  ", line)]
    assert sum(boxes) == planned <= deadline <= 570


def test_every_test_file_with_a_gpu_mark_is_in_the_gpu_tests(dry_run):
    """Found at any depth (tests/tables/storage/ too), each once, the valuable ones first."""
    _, _, logs, _ = dry_run
    marked = sorted(str(path.relative_to(ROOT)) for path in (ROOT / "tests").rglob("test_*.py")
                    if re.search(r"\bpytest\.mark\.gpu\b", path.read_text()))
    (command,) = [line for line in logs["gpu-tests"].splitlines()
                  if line.startswith("dry run: ")]
    listed = [word for word in command.split() if word.startswith("tests/")]
    assert sorted(listed) == marked and len(set(listed)) == len(listed)
    assert "tests/tables/storage/test_tiered.py" in listed
    assert listed[0] == "tests/runtime/test_kernel_cache.py" and listed.index(
        "tests/tables/test_gather_cupy.py") < listed.index("tests/torch/test_torch.py")
    assert " -n " in command and "timeout" in command


def test_the_dry_run_compiles_for_real_and_takes_cuda_home_only_with_nvvm(dry_run):
    _, summary, _, refused = dry_run
    (compile_line,) = [line for line in summary if line.startswith("compile:")]
    assert "exit 0" in compile_line
    assert "CUDA_HOME=" in summary[0] and "dry run" in summary[0]
    assert not any(str(folder) in summary[0] for folder in refused)


def test_the_header_says_how_to_bring_wheels_and_jax_does_not_preallocate():
    text = SCRIPT.read_text()
    assert "pip download --no-deps --only-binary=:all: --python-version 3.12" in text
    assert ".whl/" in text and "export XLA_PYTHON_CLIENT_PREALLOCATE=false" in text


def test_a_plan_over_the_deadline_runs_nothing(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "DEVICE_CHECK_SECONDS": "100",
           "PATH": TEST_PYTHON_FIRST}
    run = subprocess.run(["bash", str(SCRIPT), "--dry-run"], env=env, timeout=60,
                         capture_output=True)
    summary = (tmp_path / "summary.txt").read_text().splitlines()
    assert run.returncode == 2 and "budget 100 s" in summary[0]
    assert "exceed the deadline" in summary[-1] and not [s for s in summary if ": exit " in s]
