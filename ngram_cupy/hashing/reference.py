"""Plain NumPy reference for the ids and context rolling (docs/ids.md): slow, obviously right.

Every fast path is tested against these functions; they favour clarity over speed and never
share code with the kernels (``token_histories``, the EOS-cut histories in plain NumPy, is shared
with the corpus statistics, which hash the same n-grams).
"""

from __future__ import annotations

import numpy as np

from .histories import token_histories
from .layout import LayerLayout


def compute_ngram_ids(layout: LayerLayout, input_ids, query_start_loc, ngram_context) -> np.ndarray:
    """``[T, num_heads]`` int64 row ids, computed straight from the definition; tokens past
    ``query_start_loc[R]`` (padding, docs/ids.md) count as tokens of the last request."""
    history = token_histories(layout, input_ids, query_start_loc, ngram_context)
    # Wrapping int64 products and XORs are the same bits as uint64 ones.
    products = history.view(np.uint64) * layout.multipliers.view(np.uint64)
    mixed = np.bitwise_xor.accumulate(products, axis=1).view(np.int64)  # column g-1: order g
    k = layout.heads_per_ngram
    blocks = []
    for g in range(2, layout.ngram_size + 1):
        heads = slice((g - 2) * k, (g - 1) * k)
        remainder = np.remainder(mixed[:, g - 1 : g], layout.head_sizes[heads])
        blocks.append(remainder + layout.head_offsets[heads])
    return np.concatenate(blocks, axis=1).reshape(-1, layout.num_heads)


def advance_context(layout: LayerLayout, input_ids, query_start_loc, ngram_context) -> np.ndarray:
    """Each request's next context: the last n-1 tokens of its context followed by its tokens
    (padding past ``query_start_loc[R]`` is no request's)."""
    tokens = np.asarray(input_ids, dtype=np.int64)
    starts = np.asarray(query_start_loc, dtype=np.int64)
    context = np.asarray(ngram_context, dtype=np.int64)
    width = layout.ngram_size - 1
    rows = [
        np.concatenate([context[r], tokens[starts[r] : starts[r + 1]]])[-width:]
        for r in range(starts.size - 1)
    ]
    return np.array(rows, dtype=np.int64).reshape(-1, width)
