"""Token histories of a packed batch in plain NumPy: the n-grams each token's heads hash.

Shared by the reference definition of the ids (``reference.py``) and the corpus statistics
(``stats.py``), which count distinct n-grams exactly as they are hashed.
"""

from __future__ import annotations

import numpy as np

from .layout import LayerLayout


def token_histories(layout: LayerLayout, input_ids, query_start_loc, ngram_context) -> np.ndarray:
    """``[T, n]`` int64: column j holds the token j places before each token, EOS-cut."""
    tokens = np.asarray(input_ids, dtype=np.int64)
    starts = np.asarray(query_start_loc, dtype=np.int64)
    context = np.asarray(ngram_context, dtype=np.int64)
    n, eos = layout.ngram_size, layout.eos_token_id
    positions = np.arange(tokens.size)
    # Padded tokens past the last request's end (docs/ids.md) count as its tokens.
    request = np.minimum(np.searchsorted(starts, positions, side="right") - 1, starts.size - 2)
    start = starts[request]

    history = np.empty((tokens.size, n), dtype=np.int64)
    seen_eos = np.zeros(tokens.size, dtype=bool)
    for j in range(n):
        source = positions - j
        in_batch = source >= start
        # Before the request's first token, read its context: column n-1 is the newest.
        context_column = np.where(in_batch, 0, (n - 1) - (start - source))
        w = np.where(in_batch, tokens[np.maximum(source, 0)], context[request, context_column])
        if j > 0:
            w = np.where(seen_eos, eos, w)
            seen_eos |= w == eos
        history[:, j] = w
    return history
