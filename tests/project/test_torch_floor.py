"""Every extra's torch floor is the oldest torch release the suite is tested on: the oldest
torch pin among the test environment's files (an extra's floor below it would let pip resolve a
release the tests never ran on; torch 2.9.1 failed two compile tests)."""

from __future__ import annotations

from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[2]
PIN_FILES = ("constraints-ci.txt", "requirements-oldest.txt")  # what the suite is tested on


def requirements(text: str) -> list[Requirement]:
    """The requirement lines of a pip requirements file (comments and blank lines skipped)."""
    lines = (line.split("#", 1)[0].strip() for line in text.splitlines())
    return [Requirement(line) for line in lines if line]


def pinned_releases(name: str) -> list[Version]:
    """The releases of ``name`` pinned (``==``) in ``PIN_FILES``."""
    return [Version(spec.version)
            for file in PIN_FILES for requirement in requirements((ROOT / file).read_text())
            if requirement.name == name
            for spec in requirement.specifier if spec.operator == "=="]


def test_every_torch_extra_floors_at_the_oldest_tested_release():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    floors = {extra: [Version(spec.version) for spec in requirement.specifier
                      if spec.operator == ">="]
              for extra, lines in extras.items() for requirement in map(Requirement, lines)
              if requirement.name == "torch"}
    oldest = min(pinned_releases("torch"))
    assert oldest >= Version("2.11")  # 2.9.1 fails the compile tests
    assert {"torch", "transformers", "test"} <= set(floors)
    assert floors == {extra: [oldest] for extra in floors}, f"oldest tested torch: {oldest}"
