"""A clone with nothing beside it (as a user or the GPU machine gets it) collects every test."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import pytest_script

ROOT = Path(__file__).resolve().parents[2]
# Text files of the repository that code could read from (binary data is not searched).
SEARCHED = {".py", ".sh", ".toml", ".cfg", ".ini", ".txt", ".json", ".cu", ".cuh", ".h", ""}


def tracked_files() -> list[Path]:
    """The files git tracks in this checkout; skips outside a git checkout."""
    if shutil.which("git") is None:
        pytest.skip("no git")
    run = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True)
    if run.returncode:
        pytest.skip("not a git checkout")
    return [ROOT / name for name in run.stdout.decode().split("\0") if name]


def test_nothing_reads_the_folder_beside_the_repository():
    sibling = re.compile(r"\.\./shared|/work/shared|parent\.parent\s*/\s*[\"']shared")
    offenders = [
        str(path.relative_to(ROOT)) for path in tracked_files()
        if path.suffix in SEARCHED and path.is_file() and path != Path(__file__).resolve()
        and sibling.search(path.read_text(errors="replace"))
    ]
    assert not offenders


# One interpreter names the ngram_cupy it imports (the one conftest then uses) and collects.
# Assertion rewriting and the unraisable-exception plugin's closing garbage collections are
# pytest's own work, checked by every ordinary run, so they are off here.
COLLECT = ["-c", pytest_script('import ngram_cupy; print("ngram_cupy from", ngram_cupy.__file__)'),
           "--collect-only", "-q", "-m", "gpu", "-p", "no:cacheprovider", "--assert=plain",
           "-p", "no:unraisableexception"]


def test_a_bare_clone_collects_every_test(tmp_path):
    """One ``pytest -m gpu --collect-only`` in a fresh clone, its own package first on the path:
    no collection error (exit 0), the gpu tests listed, the others deselected, not missing, and
    the package collected is the clone's."""
    tracked_files()
    clone = tmp_path / "ngram_cupy"
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(ROOT), str(clone)], check=True,
                   capture_output=True)
    env = {**os.environ, "PYTHONPATH": str(clone), "PYTHONDONTWRITEBYTECODE": "1"}
    run = subprocess.run([sys.executable, *COLLECT], cwd=clone, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    gpu_items = [line for line in run.stdout.splitlines() if "::" in line]
    counts = re.search(r"(\d+)/(\d+) tests collected \((\d+) deselected\)", run.stdout)
    assert gpu_items and counts, run.stdout[-3000:]
    selected, total, deselected = map(int, counts.groups())
    assert selected == len(gpu_items) and selected + deselected == total > selected
    where = re.search(r"^ngram_cupy from (.+)$", run.stdout, re.MULTILINE)
    assert where and Path(where.group(1)).is_relative_to(clone)  # the clone's code was collected
