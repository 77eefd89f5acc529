"""How a missing extra is installed: from a clone, as README says (the package is not on the
package index, so ``pip install 'ngram-cupy[...]'`` finds nothing)."""

from __future__ import annotations


def install_hint(extra: str) -> str:
    """The command that installs ``extra`` into the environment of a clone of this library."""
    return f"pip install -e '.[{extra}]' in a clone of ngram_cupy (it is not on the package index)"
