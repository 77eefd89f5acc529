"""``ngram_cupy.jax``: ids, table lookups and row training from JAX programs (docs/jax.md):
the functions (``api.py``) run the NumPy face's own code as XLA FFI custom calls (``ffi.py``),
which reach the table, layout or optimizer they were traced with through ``runtime/handles.py``."""

from ..runtime.install_hint import install_hint

try:
    import jax  # noqa: F401  the optional extra, asked for by name
except ImportError as error:
    raise ImportError("ngram_cupy.jax needs jax: " + install_hint("jax")) from error

from .api import (
    compute_engram_ids,
    compute_ngram_ids,
    id_dtype,
    lookup,
    lookup_dtype,
    step_from_output_grad,
)

__all__ = ["compute_engram_ids", "compute_ngram_ids", "id_dtype", "lookup", "lookup_dtype",
           "step_from_output_grad"]
