"""N-gram ids of a ``[B, S]`` batch whose every row is one sequence (the shape transformers uses).

The rows are read as a packed batch of B requests of S tokens each (contiguous ids are not
copied); each row's context is its row of ``ngram_context[B, n-1]`` or, for fresh sequences, all
EOS. Left padding is no special case: pad tokens are hashed like any token, as the engines do.
"""

from __future__ import annotations

import numpy as np

from ..hashing.layout import LayerLayout, check_layout
from ..runtime.backends import HOST, bind, cupy_module
from ..runtime.checks import check_destination, check_index_array, check_out


def is_row_batch(input_ids) -> bool:
    """Whether ``input_ids`` is 2-D, the ``[B, S]`` form of ``compute_ngram_ids``."""
    return getattr(input_ids, "ndim", None) == 2 or (
        isinstance(input_ids, (list, tuple)) and np.ndim(input_ids) == 2)  # nested lists too


def require_packed(input_ids, query_start_loc, ngram_context) -> None:
    """Input that is not ``[B, S]`` must be a packed batch: 1-D ``input_ids`` with both
    ``query_start_loc`` and ``ngram_context``."""
    ndim = getattr(input_ids, "ndim", 1)
    if ndim != 1:
        raise ValueError(f"input_ids must be 1-D (a packed batch) or 2-D [B, S], got shape "
                         f"{tuple(input_ids.shape)}")
    for name, value in (("query_start_loc", query_start_loc), ("ngram_context", ngram_context)):
        if value is None:
            raise ValueError(f"{name} is required for 1-D (packed) input_ids; only 2-D "
                             "input_ids [B, S] may leave it out")


def pack_rows(layout: LayerLayout, input_ids, query_start_loc=None, ngram_context=None,
              out=None, *, stream=None):
    """``input_ids[B, S]`` (row ``b`` one sequence after the tokens ``ngram_context[b]``,
    oldest first; None: all EOS) as one packed batch: ``(call, (tokens, query_start_loc,
    ngram_context, out), shape)``, for ``compute_ngram_ids`` to hash and reshape to ``shape``
    (``[B, S, num_heads]``). ``query_start_loc`` must be None (the rows are the requests)."""
    check_layout(layout)
    if query_start_loc is not None:
        raise ValueError("query_start_loc must be None for 2-D input_ids [B, S]: every row is "
                         "one sequence")
    check_destination("out", out)
    call = bind(stream, input_ids=input_ids, ngram_context=ngram_context, out=out)
    tokens = call["input_ids"]
    check_index_array("input_ids", tokens, 2)
    rows, length = tokens.shape
    shape = (rows, length, layout.num_heads)
    xp = np if call.side is HOST else cupy_module()
    with call.on():
        context = call["ngram_context"]
        if context is None:
            context = xp.full((rows, layout.ngram_size - 1), layout.eos_token_id, tokens.dtype)
        starts = xp.arange(rows + 1, dtype=np.int64) * length
        flat_out = None
        if call["out"] is not None:
            check_out("out", call["out"], shape, np.int64)
            flat_out = call["out"].reshape(rows * length, layout.num_heads)
        flat = call.side.contiguous(tokens).reshape(rows * length)
    return call, (flat, starts, context, flat_out), shape
