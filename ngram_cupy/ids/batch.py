"""Checks of a packed batch (docs/ids.md): shapes and dtypes, then the request starts' values.

Shape and dtype checks read only metadata, so they cost nothing on GPU arrays; the value checks
of ``query_start_loc`` need host data and run on the CPU path only. A batch may be padded to a
captured CUDA-graph size (docs/ids.md): ``input_ids`` then holds tokens past ``query_start_loc[R]``,
which get ids as if they belonged to the last request; a batch with no request has nothing to pad.
"""

from __future__ import annotations

import numpy as np

from ..hashing.layout import LayerLayout
from ..runtime.checks import check_index_array


def check_batch(layout: LayerLayout, input_ids, query_start_loc, ngram_context) -> tuple[int, int]:
    """Check shapes and dtypes of a packed batch; return ``(num_tokens, num_requests)``."""
    check_index_array("input_ids", input_ids, 1)
    check_index_array("query_start_loc", query_start_loc, 1)
    check_index_array("ngram_context", ngram_context, 2)
    num_tokens = input_ids.shape[0]
    if query_start_loc.shape[0] < 1:
        raise ValueError("query_start_loc must hold at least one entry (0 for an empty batch)")
    num_requests = query_start_loc.shape[0] - 1
    if num_requests == 0 and num_tokens:
        raise ValueError(f"query_start_loc holds no request but input_ids has {num_tokens} tokens "
                         "(padded tokens belong to the last request, so a padded batch needs one)")
    width = layout.ngram_size - 1
    if ngram_context.shape[1] != width or ngram_context.shape[0] < num_requests:
        raise ValueError(
            f"ngram_context must have shape [R' >= {num_requests}, ngram_size - 1 = {width}], "
            f"got {tuple(ngram_context.shape)}"
        )
    return num_tokens, num_requests


def check_query_start_loc_values(query_start_loc: np.ndarray, num_tokens: int,
                                 padded: bool = True) -> None:
    """Host-side: ``0 = q_0 <= q_1 <= ... <= q_R <= T``, so no kernel reads out of bounds
    (tokens past ``q_R`` are padding, docs/ids.md; ``padded=False``: ``q_R == T``)."""
    if query_start_loc[0] != 0:
        raise ValueError(f"query_start_loc must start at 0, got {int(query_start_loc[0])}")
    if not padded and query_start_loc[-1] != num_tokens:
        raise ValueError(
            f"query_start_loc must end at the number of tokens {num_tokens} (no padding "
            f"tokens), got {int(query_start_loc[-1])}"
        )
    if query_start_loc[-1] > num_tokens:
        raise ValueError(
            f"query_start_loc must end at most at the number of tokens {num_tokens}, "
            f"got {int(query_start_loc[-1])}"
        )
    if query_start_loc.shape[0] > 2 and np.any(query_start_loc[1:] < query_start_loc[:-1]):
        raise ValueError("query_start_loc must be non-decreasing")
