"""Every install line of the README and docs works from a clone as written: the package is not
on the package index, so it is installed editable from the clone (``pip install -e ".[x]"``),
with extras that ``pyproject.toml`` defines; never ``pip install 'ngram-cupy[x]'``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ngram_cupy.runtime.install_hint import install_hint

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FROM_CLONE = re.compile(r"""pip install -e ["']?\.(?:\[([\w,]+)\])?["']?""")


def test_install_lines_work_from_a_clone():
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"])
    named = set()
    for page in PAGES:
        text = " ".join(page.read_text().split())  # lines joined: a command may wrap
        assert not re.search(r"ngram[-_]cupy\[", text), f"{page.name} installs from the index"
        for match in FROM_CLONE.finditer(text):
            named.update(filter(None, (match.group(1) or "").split(",")))
    assert named and named <= extras, named - extras
    assert FROM_CLONE.search(install_hint("jax")).group(1) == "jax"
