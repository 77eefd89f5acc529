"""The transformers tests once more on the oldest supported release (requirements-oldest.txt):
``sh scripts/setup.sh test`` installs it into ``.venv/oldest``, put first on the path here."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import pytest_script

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
OLDEST = ROOT / ".venv" / "oldest"


HERE = Path(__file__).resolve()
WHOLE_MODULE = re.compile(r"^pytestmark = \[?pytest\.mark\.release_independent\b", re.MULTILINE)
# (a module marked so as a whole has nothing to run on the oldest)
FILES = sorted(path.relative_to(ROOT).as_posix()
               for path in ROOT.glob("tests/**/test_transformers*.py")
               if path.resolve() != HERE and not WHOLE_MODULE.search(path.read_text()))


# One interpreter names its transformers and runs every file: one start, one collection (the
# unraisable-exception plugin's closing garbage collections, seconds here, are off).
RUN = pytest_script('import transformers; print("transformers", transformers.__version__)')


def test_the_oldest_supported_release_passes_the_transformers_tests():
    """Each ``test_transformers*.py`` but this one, in one fresh interpreter whose transformers
    is the oldest supported release: the tests of transformers' side (its forward, generate,
    caches, training), not those marked ``release_independent``; a failure names its tests."""
    pinned = re.search(r"^transformers==(\S+)$", (ROOT / "requirements-oldest.txt").read_text(),
                       re.MULTILINE).group(1)
    if not (OLDEST / f"transformers-{pinned}.dist-info").is_dir():
        if os.environ.get("CI"):
            pytest.fail(f"transformers {pinned} is not in {OLDEST}: sh scripts/setup.sh test "
                        "installs it")
        pytest.skip(f"transformers {pinned} is not in {OLDEST} (sh scripts/setup.sh test)")
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join(filter(None, (str(OLDEST), os.environ.get("PYTHONPATH"))))}
    run = subprocess.run([sys.executable, "-c", RUN, "-v", "-p", "no:cacheprovider",
                          "-p", "no:xdist", "-p", "no:unraisableexception",
                          "-m", "not release_independent", *FILES],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    version = re.search(r"^transformers (\S+)$", run.stdout, re.MULTILINE)
    assert version and version.group(1) == pinned, run.stdout[-2000:] + run.stderr[-2000:]
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", run.stdout, re.MULTILINE)
    assert run.returncode == 0 and not failed, (
        f"transformers {pinned}: {failed}\n{run.stdout[-4000:]}{run.stderr[-2000:]}")
    ran = [name for name in FILES if re.search(rf"^{re.escape(name)}::\S+ PASSED", run.stdout,
                                                re.MULTILINE)]
    assert ran == FILES, run.stdout[-4000:]  # each file had tests that passed
