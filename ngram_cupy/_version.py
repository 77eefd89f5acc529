"""The installed distribution's version: a leaf module, so any module may ask for it."""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=1)
def package_version() -> str:
    """The version of the installed ``ngram-cupy`` (``0+unknown`` for a source tree on
    ``PYTHONPATH``, which has no metadata); read once."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ngram-cupy")
    except PackageNotFoundError:
        return "0+unknown"
