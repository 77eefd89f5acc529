"""N-gram ids: every backend against the golden vectors and the reference; chunking; errors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ngram_cupy as nc
from ngram_cupy.hashing import reference
from ngram_cupy.ids.ids_numba import ngram_ids_numba


def _numba(parallel):
    def run(layout, input_ids, query_start_loc, ngram_context):
        out = np.empty((len(input_ids), layout.num_heads), dtype=np.int64)
        return ngram_ids_numba(layout, input_ids, query_start_loc, ngram_context, out,
                               parallel=parallel)
    return run


# Every implementation of the ids; each is checked against the golden files and the reference.
BACKENDS = {
    "reference": reference.compute_ngram_ids,
    "public": nc.compute_ngram_ids,
    "numba-serial": _numba(False),
    "numba-parallel": _numba(True),
}


@pytest.mark.parametrize("backend", BACKENDS)
def test_golden_ids(golden, backend):
    layout, _, batches = golden
    for batch in batches:
        ids = BACKENDS[backend](layout, batch["input_ids"], batch["query_start_loc"],
                                batch["ngram_context"])
        np.testing.assert_array_equal(ids, batch["ngram_ids"])


# (ngram_size, heads_per_ngram) pairs: every order 2..5 and head count 1..4 appears. The kernels
# are one code with n and k unrolled as constants, so the other pairs would add compiles (each
# a second or more, times serial/threaded and two index types), not paths; three of these are
# the golden files' shapes, compiled already (tests/simulator.py's layouts use them too).
SHAPES = [(2, 1), (3, 2), (4, 4), (5, 3)]
# int32 inputs (the dtype dispatch: loads and sign extension, the same for every shape) with an
# odd and an even head count only: each other shape would add two compiles.
INT32_SHAPES = [(2, 1), (4, 4)]
# Shapes the random batches run on threads too: the golden files' (test_golden_ids compiles their
# threaded kernels). A random batch is one block of tokens, the serial kernel's loop; a 5-gram's
# threaded kernel would be a compile of its own.
THREADED_SHAPES = [(2, 1), (3, 2), (4, 4)]


def threaded_case(name: str, layout, tokens) -> bool:
    """Whether the random-batch tests run backend ``name`` on this case: all but the threaded
    kernel, which runs int64 tokens of ``THREADED_SHAPES`` (int32 threaded: test_cli's runs)."""
    shape = (layout.ngram_size, layout.heads_per_ngram)
    return name != "numba-parallel" or (tokens.dtype == np.int64 and shape in THREADED_SHAPES)


@st.composite
def packed_batches(draw, max_tokens=120):
    """A random layout and packed batch: EOS-heavy, out-of-range and negative tokens, empties."""
    n, k = draw(st.sampled_from(SHAPES))
    vocab = draw(st.integers(2, 3000))
    config = nc.NGramConfig(
        vocab_size=vocab, ngram_size=n, heads_per_ngram=k,
        ngram_vocab_size_base=draw(st.integers(1, 5000)),
        eos_token_id=draw(st.integers(0, vocab - 1)),
        seed=draw(st.integers(0, 2**40)),
        make_ngram_vocab_size_divisible_by=draw(st.sampled_from([1, 8, 512])),
    )
    layout = nc.layer_layout(config, draw(st.integers(0, 3)))
    eos = config.eos_token_id
    token = st.one_of(
        st.just(eos),
        st.integers(0, vocab - 1),
        st.integers(-(2**63), 2**63 - 1),  # out of range: products wrap, mixes go negative
    )
    num_tokens = draw(st.integers(0, max_tokens))
    tokens = draw(st.lists(token, min_size=num_tokens, max_size=num_tokens))
    cuts = sorted(draw(st.lists(st.integers(0, num_tokens), max_size=8)))
    starts = [0, *cuts, num_tokens]
    spare_rows = draw(st.integers(0, 2))
    context = draw(st.lists(token, min_size=(len(starts) - 1 + spare_rows) * (n - 1),
                            max_size=(len(starts) - 1 + spare_rows) * (n - 1)))
    dtype = draw(st.sampled_from([np.int32, np.int64] if (n, k) in INT32_SHAPES else [np.int64]))
    tokens = np.array(tokens, dtype=np.int64)
    context = np.array(context, dtype=np.int64).reshape(-1, n - 1)
    if dtype is np.int32:
        tokens = np.clip(tokens, -(2**31), 2**31 - 1).astype(np.int32)
        context = np.clip(context, -(2**31), 2**31 - 1).astype(np.int32)
    return layout, tokens, np.array(starts, dtype=dtype), context


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(packed_batches())
def test_backends_match_reference(case):
    layout, tokens, starts, context = case
    expected = reference.compute_ngram_ids(layout, tokens, starts, context)
    for name, backend in BACKENDS.items():
        if not threaded_case(name, layout, tokens):
            continue
        np.testing.assert_array_equal(backend(layout, tokens, starts, context), expected,
                                      err_msg=name)


@settings(max_examples=100, deadline=None)
@given(packed_batches())
def test_advance_context_matches_reference(case):
    layout, tokens, starts, context = case
    expected = reference.advance_context(layout, tokens, starts, context)
    np.testing.assert_array_equal(nc.advance_context(layout, tokens, starts, context), expected)


@st.composite
def padded_batches(draw):
    """A batch of at least one request, padded with 1-20 tokens past ``query_start_loc[R]``
    (SPEC 10.3): EOS, valid and wild ids, as an engine's padding may hold anything."""
    layout, tokens, starts, context = draw(packed_batches(max_tokens=60))
    info = np.iinfo(tokens.dtype)
    token = st.one_of(st.just(layout.eos_token_id), st.integers(0, layout.config.vocab_size - 1),
                      st.integers(int(info.min), int(info.max)))
    padding = np.array(draw(st.lists(token, min_size=1, max_size=20)), dtype=tokens.dtype)
    return layout, tokens, np.concatenate([tokens, padding]), starts, context


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(padded_batches())
def test_padded_batches_give_vllm_ids(case):
    """Padding leaves the real tokens' ids alone; a padded token's ids are those it would have
    appended to the last request (vLLM's kernel: its request search clamps to R - 1)."""
    layout, tokens, padded, starts, context = case
    real = reference.compute_ngram_ids(layout, tokens, starts, context)
    extended = starts.copy()
    extended[-1] = padded.size  # the last request owns the padding
    appended = reference.compute_ngram_ids(layout, padded, extended, context)
    np.testing.assert_array_equal(appended[: tokens.size], real)  # the definition agrees
    np.testing.assert_array_equal(reference.compute_ngram_ids(layout, padded, starts, context),
                                  appended)
    for name, backend in BACKENDS.items():
        if not threaded_case(name, layout, padded):
            continue
        ids = backend(layout, padded, starts, context)
        np.testing.assert_array_equal(ids[: tokens.size], real, err_msg=name)
        np.testing.assert_array_equal(ids, appended, err_msg=name)
    np.testing.assert_array_equal(nc.advance_context(layout, padded, starts, context),
                                  reference.advance_context(layout, tokens, starts, context))


def test_padding_after_an_empty_last_request_reads_its_context():
    """The last request may be empty (a finished slot): the padding then hashes its context."""
    layout = nc.layer_layout(nc.NGramConfig(100, 3, 2, 50, 0), 0)  # a golden file's (n, k)
    tokens = np.array([5, 6, 7, 8, 9], dtype=np.int64)
    context = np.array([[1, 2], [3, 4]], dtype=np.int64)
    padded = nc.compute_ngram_ids(layout, tokens, np.array([0, 3, 3]), context)
    alone = nc.compute_ngram_ids(layout, tokens[3:], np.array([0, 2]), context[1:])
    np.testing.assert_array_equal(padded[3:], alone)
    long_batch = np.concatenate([tokens, np.zeros(2000, np.int64)])  # whole blocks past q_R
    want = reference.compute_ngram_ids(layout, long_batch, np.array([0, 3, 3]), context)
    for threaded in (False, True):
        np.testing.assert_array_equal(
            _numba(threaded)(layout, long_batch, np.array([0, 3, 3]), context), want)


def test_a_batch_of_no_request_takes_no_tokens():
    """R = 0 with tokens: vLLM's kernel reads ``query_start_loc[-1]`` there (outside the array)
    and its torch path fails, so there is nothing to match: a ValueError, on every path."""
    layout = nc.layer_layout(nc.NGramConfig(100, 3, 1, 50, 0), 0)
    for call in (nc.compute_ngram_ids, nc.advance_context):
        with pytest.raises(ValueError, match="query_start_loc holds no request but input_ids "
                                             "has 2 tokens"):
            call(layout, np.array([1, 2]), np.array([0]), np.zeros((3, 2), np.int64))


def test_advance_context_in_place():
    layout = nc.layer_layout(nc.NGramConfig(100, 4, 1, 50, 0), 0)
    tokens = np.array([5, 6, 7, 8, 9], dtype=np.int64)
    starts = np.array([0, 1, 1, 5])
    context = np.array([[1, 2, 3], [4, 5, 6], [7, 8, 9], [-1, -1, -1]], dtype=np.int64)
    nc.advance_context(layout, tokens, starts, context, out=context[:3])
    np.testing.assert_array_equal(context, [[2, 3, 5], [4, 5, 6], [7, 8, 9], [-1, -1, -1]])


@settings(max_examples=60, deadline=None)
@given(packed_batches(max_tokens=60), st.data())
def test_chunked_equals_whole(case, data):
    """Requests fed in chunks of any size (0, 1 for decode, more) with rolled contexts."""
    layout, tokens, starts, context = case
    whole = nc.compute_ngram_ids(layout, tokens, starts, context)
    num_requests = len(starts) - 1
    state = context.copy()  # a persistent per-request buffer, rolled in place
    done = starts[:-1].astype(np.int64).copy()
    pieces = [[] for _ in range(num_requests)]
    while np.any(done < starts[1:]) or not any(pieces):
        sizes = [data.draw(st.integers(0, int(starts[r + 1] - done[r])), label=f"chunk {r}")
                 for r in range(num_requests)]
        chunk_starts = np.concatenate([[0], np.cumsum(sizes)]).astype(starts.dtype)
        chunk = np.concatenate(
            [tokens[done[r] : done[r] + sizes[r]] for r in range(num_requests)] or [tokens[:0]]
        ).astype(tokens.dtype)
        ids = nc.compute_ngram_ids(layout, chunk, chunk_starts, state)
        for r in range(num_requests):
            pieces[r].append(ids[chunk_starts[r] : chunk_starts[r + 1]])
        nc.advance_context(layout, chunk, chunk_starts, state, out=state[:num_requests])
        done += sizes
        if num_requests == 0:
            break
    for r in range(num_requests):
        np.testing.assert_array_equal(np.concatenate(pieces[r]),
                                      whole[starts[r] : starts[r + 1]])


def test_decode_one_token_at_a_time_equals_prefill():
    layout = nc.layer_layout(nc.NGramConfig(50, 3, 2, 31, 0), 1)
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 50, 40)
    tokens[[5, 6, 20]] = 0
    fresh = np.zeros((1, 2), dtype=np.int64)
    whole = nc.compute_ngram_ids(layout, tokens, [0, 40], fresh)
    state = fresh.copy()
    for t in range(40):
        one = tokens[t : t + 1]
        ids = nc.compute_ngram_ids(layout, one, [0, 1], state)
        np.testing.assert_array_equal(ids, whole[t : t + 1])
        nc.advance_context(layout, one, [0, 1], state, out=state)


def test_long_batch_uses_threads_and_matches_reference(released_config):
    layout = nc.layer_layout(released_config, 0)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, released_config.vocab_size, 50_000)
    tokens[rng.random(tokens.size) < 0.02] = released_config.eos_token_id
    starts = np.array([0, 7, 7, 20_000, 50_000])
    context = rng.integers(0, released_config.vocab_size, (4, 2))
    np.testing.assert_array_equal(nc.compute_ngram_ids(layout, tokens, starts, context),
                                  reference.compute_ngram_ids(layout, tokens, starts, context))


def test_empty_batches():
    layout = nc.layer_layout(nc.NGramConfig(50, 3, 2, 31, 0), 0)
    none = np.zeros(0, dtype=np.int64)
    assert nc.compute_ngram_ids(layout, none, [0], np.zeros((0, 2), np.int64)).shape == (0, 4)
    assert nc.compute_ngram_ids(layout, none, [0, 0, 0], np.zeros((2, 2), np.int64)).shape == (0, 4)
    assert nc.advance_context(layout, none, [0], np.zeros((0, 2), np.int64)).shape == (0, 2)


def test_out_is_filled_and_returned():
    layout = nc.layer_layout(nc.NGramConfig(50, 3, 2, 31, 0), 0)
    tokens = np.arange(10)
    out = np.full((10, 4), -1, dtype=np.int64)
    result = nc.compute_ngram_ids(layout, tokens, [0, 10], np.zeros((1, 2), np.int64), out=out)
    assert result is out
    np.testing.assert_array_equal(out, reference.compute_ngram_ids(layout, tokens, [0, 10],
                                                                   np.zeros((1, 2), np.int64)))


LAYOUT = nc.layer_layout(nc.NGramConfig(50, 3, 2, 31, 0), 0)
TOKENS = np.arange(6, dtype=np.int64)
STARTS = np.array([0, 2, 6])
CONTEXT = np.zeros((3, 2), dtype=np.int64)  # R' = 3 >= R: spare rows are allowed


@pytest.mark.parametrize(
    "change, error, name",
    [
        (dict(input_ids=TOKENS.reshape(2, 3)), ValueError, "input_ids"),
        (dict(input_ids=TOKENS.astype(np.float64)), TypeError, "input_ids"),
        (dict(input_ids=TOKENS.astype(np.uint8)), TypeError, "input_ids"),
        (dict(query_start_loc=np.array([1, 2, 6])), ValueError, "query_start_loc"),
        (dict(query_start_loc=np.array([0, 4, 2, 6])), ValueError, "query_start_loc"),
        (dict(query_start_loc=np.array([0])), ValueError, "query_start_loc holds no request"),
        (dict(query_start_loc=np.array([0, 2, 7])), ValueError, "query_start_loc"),
        (dict(query_start_loc=np.zeros(0, np.int64)), ValueError, "query_start_loc"),
        (dict(query_start_loc=np.array([[0, 6]])), ValueError, "query_start_loc"),
        (dict(query_start_loc=np.array([0.0, 6.0])), TypeError, "query_start_loc"),
        (dict(ngram_context=np.zeros((3, 3), np.int64)), ValueError, "ngram_context"),
        (dict(ngram_context=np.zeros((1, 2), np.int64)), ValueError, "ngram_context"),
        (dict(ngram_context=np.zeros(4, np.int64)), ValueError, "ngram_context"),
        (dict(ngram_context=np.zeros((2, 2), np.float32)), TypeError, "ngram_context"),
        (dict(out=np.zeros((6, 3), np.int64)), ValueError, "out"),
        (dict(out=np.zeros((6, 4), np.int32)), TypeError, "out"),
        (dict(out=np.zeros((4, 6), np.int64).T), ValueError, "out"),
        (dict(layout="layout"), TypeError, "layout"),
    ],
)
def test_bad_inputs_name_the_argument(change, error, name):
    args = dict(layout=LAYOUT, input_ids=TOKENS, query_start_loc=STARTS, ngram_context=CONTEXT)
    args.update(change)
    with pytest.raises(error, match=name):
        nc.compute_ngram_ids(**args)


def test_read_only_out_is_refused():
    out = np.zeros((6, 4), np.int64)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="out"):
        nc.compute_ngram_ids(LAYOUT, TOKENS, STARTS, CONTEXT, out=out)
    with pytest.raises(ValueError, match="out"):
        nc.advance_context(LAYOUT, TOKENS, STARTS, CONTEXT, out=np.zeros((3, 2), np.int64))


# --- hostile inputs (issue 9) -------------------------------------------------------------------


@pytest.mark.parametrize("out", [[], [[0, 0, 0, 0]] * 6, (0,)], ids=["empty", "nested", "tuple"])
def test_silent_wrong_out_a_python_list_is_a_type_error(out):
    with pytest.raises(TypeError, match="out must be an array.*list|out must be an array.*tuple"):
        nc.compute_ngram_ids(LAYOUT, TOKENS, STARTS, CONTEXT, out=out)
    with pytest.raises(TypeError, match="out must be an array"):
        nc.advance_context(LAYOUT, TOKENS, STARTS, CONTEXT, out=out)


def test_silent_wrong_advance_context_int32_context_keeps_an_int64_token_whole():
    token = 2**40 + 7
    tokens = np.array([5, token], dtype=np.int64)
    context = np.zeros((1, 2), dtype=np.int32)
    rolled = nc.advance_context(LAYOUT, tokens, np.array([0, 2]), context)
    assert rolled.dtype == np.int64
    np.testing.assert_array_equal(rolled, [[5, token]])
    with pytest.raises(TypeError, match="out must have dtype int64"):
        nc.advance_context(LAYOUT, tokens, np.array([0, 2]), context, out=context)
    same = nc.advance_context(LAYOUT, tokens.astype(np.int32), np.array([0, 2]), context)
    assert same.dtype == np.int32  # no widening when nothing needs it
