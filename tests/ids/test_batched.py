"""compute_ngram_ids on [B, S] rows: each row one sequence, equal to the packed reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ngram_cupy as nc
from ngram_cupy.hashing import reference

CONFIG = nc.NGramConfig(vocab_size=50, ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=40,
                        eos_token_id=3, make_ngram_vocab_size_divisible_by=8)
LAYOUT = nc.layer_layout(CONFIG, 1)


def packed_reference(tokens: np.ndarray, context: np.ndarray | None) -> np.ndarray:
    """The plain NumPy reference on the rows laid end to end, one request per row."""
    rows, length = tokens.shape
    if context is None:
        context = np.full((rows, CONFIG.ngram_size - 1), CONFIG.eos_token_id, np.int64)
    starts = np.arange(rows + 1, dtype=np.int64) * length
    ids = reference.compute_ngram_ids(LAYOUT, tokens.reshape(-1), starts, context)
    return ids.reshape(rows, length, LAYOUT.num_heads)


@st.composite
def row_batches(draw):
    """Rows of tokens (EOS often, padding-like runs too) and maybe a context per row."""
    rows, length = draw(st.integers(0, 4)), draw(st.integers(0, 7))
    token = st.one_of(st.just(CONFIG.eos_token_id), st.integers(0, CONFIG.vocab_size - 1))
    tokens = np.array(draw(st.lists(token, min_size=rows * length, max_size=rows * length)),
                      np.int64).reshape(rows, length)
    context = None
    if draw(st.booleans()):
        context = np.array(draw(st.lists(token, min_size=rows * 2, max_size=rows * 2)),
                           np.int64).reshape(rows, 2)
    return tokens, context


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(row_batches())
def test_rows_match_the_packed_reference(case):
    tokens, context = case
    got = nc.compute_ngram_ids(LAYOUT, tokens, ngram_context=context)
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, packed_reference(tokens, context))


def test_each_row_is_its_own_sequence():
    """A row's ids do not depend on the other rows (no history across rows)."""
    tokens = np.array([[5, 6, 7, 8], [9, 10, 11, 12]])
    both = nc.compute_ngram_ids(LAYOUT, tokens)
    for row in range(2):
        alone = nc.compute_ngram_ids(LAYOUT, tokens[row:row + 1])
        np.testing.assert_array_equal(both[row], alone[0])


def test_nested_lists_are_rows():
    """A [B, S] nested list is rows, as a 1-D list is a packed batch (it was read as 1-D and
    refused for a missing query_start_loc)."""
    tokens = [[5, 6, 7, 8], [9, 10, 11, 12]]
    got = nc.compute_ngram_ids(LAYOUT, tokens, None, [[1, 2], [3, 4]])
    want = packed_reference(np.array(tokens), np.array([[1, 2], [3, 4]]))
    np.testing.assert_array_equal(got, want)


def test_torch_in_torch_out_int32_and_strided():
    tokens = torch.arange(24, dtype=torch.int32).reshape(3, 8) % CONFIG.vocab_size
    strided = tokens[:, ::2]  # not contiguous: copied, not refused
    context = torch.tensor([[1, 2], [3, 3], [4, 5]], dtype=torch.int32)
    got = nc.compute_ngram_ids(LAYOUT, strided, None, context)
    assert isinstance(got, torch.Tensor) and got.shape == (3, 4, LAYOUT.num_heads)
    want = packed_reference(strided.numpy().astype(np.int64), context.numpy().astype(np.int64))
    np.testing.assert_array_equal(got.numpy(), want)


def test_out_is_filled_and_returned():
    tokens = np.array([[5, 3, 7], [1, 2, 3]])
    out = np.full((2, 3, LAYOUT.num_heads), -1, np.int64)
    assert nc.compute_ngram_ids(LAYOUT, tokens, out=out) is out
    np.testing.assert_array_equal(out, packed_reference(tokens, None))


@pytest.mark.parametrize("call, error, match", [
    (lambda: nc.compute_ngram_ids(LAYOUT, np.zeros((2, 3), np.int64), np.array([0, 3, 6])),
     ValueError, "query_start_loc must be None"),
    (lambda: nc.compute_ngram_ids(LAYOUT, np.zeros(3, np.int64)), ValueError,
     "query_start_loc is required"),
    (lambda: nc.compute_ngram_ids(LAYOUT, np.zeros((1, 2, 3), np.int64)), ValueError,
     "input_ids must be 1-D"),
    (lambda: nc.compute_ngram_ids(LAYOUT, np.zeros((2, 3))), TypeError, "input_ids"),
    (lambda: nc.compute_ngram_ids(LAYOUT, np.zeros((2, 3), np.int64), None,
                                  np.zeros((1, 2), np.int64)), ValueError, "ngram_context"),
    (lambda: nc.compute_ngram_ids(LAYOUT, np.zeros((2, 3), np.int64), None,
                                  np.zeros((2, 3), np.int64)), ValueError, "ngram_context"),
    (lambda: nc.compute_ngram_ids(LAYOUT, np.zeros((2, 3), np.int64),
                                  out=np.zeros((6, LAYOUT.num_heads), np.int64)),
     ValueError, "out must have shape"),
])
def test_bad_input_names_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call()
