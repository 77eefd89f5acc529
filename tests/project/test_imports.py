"""``import ngram_cupy`` stays light: heavy dependencies load only with the parts that use them."""

from __future__ import annotations

import subprocess
import sys

import ngram_cupy

HEAVY = ("safetensors", "tqdm", "torch", "cupy", "numba.cuda", "pyarrow", "jax")


def test_import_and_config_load_no_heavy_dependency():
    code = ("import sys, ngram_cupy; ngram_cupy.NGramConfig; ngram_cupy.layer_layout; "
            f"print(' '.join(m for m in {HEAVY!r} if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == []


def test_every_public_name_resolves():
    for name in ngram_cupy.__all__:
        assert getattr(ngram_cupy, name).__name__ == name
    assert set(ngram_cupy.__all__) <= set(dir(ngram_cupy))


def test_dir_shows_only_public_names():
    """Helpers and imported modules (``importlib``, ``_EXPORTS``, subpackages) stay out."""
    ngram_cupy.compute_ngram_ids  # noqa: B018  imports ngram_cupy.ids as a side effect
    assert dir(ngram_cupy) == sorted([*ngram_cupy.__all__, "__version__"])


def test_the_lazy_table_names_every_export():
    assert sorted(ngram_cupy.__all__) == sorted(vars(ngram_cupy)["_EXPORTS"])
