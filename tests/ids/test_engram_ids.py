"""Engram ids (SPEC 11) on the CPU: golden cases, the plain reference on random batches, chunked
equals whole with the rolled lookback, dead tokens, torch in and out, and bad inputs."""

from __future__ import annotations

import engram_cases
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ngram_cupy as nc
from ngram_cupy.hashing import engram_reference as reference
from ngram_cupy.ids.engram_numba import engram_ids_numba


def numba_ids(layout, parallel, **batch):
    """The Numba kernel called directly, serial or threaded whatever the batch size."""
    num_tokens, width = len(batch["input_ids"]), layout.ngram_size - 1
    out = np.full((num_tokens, layout.num_layers, layout.num_heads), -7, dtype=np.int32)
    lookback = batch.get("lookback_token_ids")
    dead = batch.get("dead_mask")
    lookback_dead = batch.get("lookback_dead_mask")
    return engram_ids_numba(
        layout, batch["input_ids"], batch["positions"], batch["query_start_loc"],
        np.zeros(0, np.uint8) if dead is None else dead.view(np.uint8),
        np.zeros((0, width), np.int64) if lookback is None else lookback,
        np.zeros((0, width), np.uint8) if lookback_dead is None else lookback_dead.view(np.uint8),
        out, parallel=parallel)


BACKENDS = {
    "public": nc.compute_engram_ids,
    "numba-serial": lambda layout, **batch: numba_ids(layout, False, **batch),
    "numba-parallel": lambda layout, **batch: numba_ids(layout, True, **batch),
}


@pytest.mark.parametrize("backend", [*BACKENDS, "reference"])
def test_golden_synthetic_map(backend):
    layout, case = engram_cases.load_golden("synthetic")
    assert layout.multipliers.tolist() == case["layout"]["multipliers"]
    assert layout.head_sizes.tolist() == case["layout"]["head_sizes"]
    assert layout.head_offsets.tolist() == case["layout"]["head_offsets"]
    assert layout.pad_id == case["layout"]["pad_id"]
    compute = BACKENDS.get(backend, reference.compute_engram_ids)
    for batch in case["batches"]:
        args, expected = engram_cases.golden_batch(batch)
        np.testing.assert_array_equal(compute(layout, **args), expected)


# The shape whose threaded kernel the random batches run too: the synthetic golden case's,
# which test_golden_synthetic_map compiles threaded anyway (each other shape's threaded kernel
# is a compile of 3-4 s; the long batch below runs several blocks on threads).
THREADED_SHAPES = engram_cases.SHAPES[-1:]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), shape=st.sampled_from(engram_cases.SHAPES),
       num_tokens=st.integers(0, 90), num_requests=st.integers(1, 6),
       dead_rate=st.sampled_from([0.0, 0.1, 0.5]))
def test_random_batches_equal_the_reference(seed, shape, num_tokens, num_requests, dead_rate):
    rng = np.random.default_rng(seed)
    layout = engram_cases.small_layout(rng, shape)
    batch = engram_cases.random_batch(rng, layout, num_tokens, num_requests, dead_rate)
    expected = reference.compute_engram_ids(layout, **batch)
    for name, compute in BACKENDS.items():
        if name == "numba-parallel" and shape not in THREADED_SHAPES:
            continue  # one block of tokens here, as the serial kernel runs them
        np.testing.assert_array_equal(compute(layout, **batch), expected, err_msg=name)
    # Without lookback or masks: unknown history reads the pad id, nothing is dead.
    plain = {name: batch[name] for name in ("input_ids", "positions", "query_start_loc")}
    np.testing.assert_array_equal(nc.compute_engram_ids(layout, **plain),
                                  reference.compute_engram_ids(layout, **plain))


def test_int32_inputs_and_a_long_parallel_batch():
    rng = np.random.default_rng(11)
    layout = engram_cases.small_layout(rng, engram_cases.SHAPES[1])
    batch = engram_cases.random_batch(rng, layout, 3000, 7)
    expected = reference.compute_engram_ids(layout, **batch)
    np.testing.assert_array_equal(nc.compute_engram_ids(layout, **batch), expected)
    as32 = {name: value.astype(np.int32) if value.dtype == np.int64 else value
            for name, value in batch.items()}
    np.testing.assert_array_equal(nc.compute_engram_ids(layout, **as32), expected)


def chunked_ids(layout, sequences, dead, cuts):
    """The ids of several sequences fed together in chunks: each step takes the next piece of
    every sequence (cut at ``cuts``), with the lookback rolled from the previous step."""
    width = layout.ngram_size - 1
    lookback = np.full((len(sequences), width), -1, dtype=np.int64)
    lookback_dead = np.zeros((len(sequences), width), dtype=bool)
    done = [0] * len(sequences)
    pieces = [[] for _ in sequences]
    for step_cuts in cuts:
        tokens, flags, positions, starts = [], [], [], [0]
        for s, cut in enumerate(step_cuts):
            end = min(len(sequences[s]), done[s] + cut)
            tokens.extend(sequences[s][done[s]:end])
            flags.extend(dead[s][done[s]:end])
            positions.extend(range(done[s], end))
            starts.append(len(tokens))
        tokens, flags = np.array(tokens, np.int64), np.array(flags, bool)
        starts = np.array(starts, np.int64)
        ids = nc.compute_engram_ids(layout, tokens, np.array(positions, np.int64), starts,
                                    lookback, flags, lookback_dead)
        nc.advance_engram_lookback(layout, tokens, starts, lookback, out=lookback)
        nc.advance_engram_lookback(layout, flags, starts, lookback_dead, out=lookback_dead)
        for s in range(len(sequences)):
            pieces[s].append(ids[starts[s]:starts[s + 1]])
            done[s] += starts[s + 1] - starts[s]
    return [np.concatenate(p) if p else np.zeros((0,)) for p in pieces], done


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), shape=st.sampled_from(engram_cases.SHAPES[1:]),
       data=st.data())
def test_chunked_equals_whole(seed, shape, data):
    """Prefill in pieces of any size (0 and 1 included) then decode: the same ids as whole."""
    rng = np.random.default_rng(seed)
    layout = engram_cases.small_layout(rng, shape)
    lengths = data.draw(st.lists(st.integers(0, 25), min_size=1, max_size=3))
    sequences = [rng.integers(0, layout.vocab_size, n) for n in lengths]
    dead = [rng.random(n) < 0.1 for n in lengths]
    cuts = data.draw(st.lists(st.lists(st.integers(0, 6), min_size=len(lengths),
                                       max_size=len(lengths)), min_size=1, max_size=8))
    cuts.append([25] * len(lengths))  # the rest in one step
    pieces, done = chunked_ids(layout, sequences, dead, cuts)
    assert done == lengths
    for tokens, flags, got in zip(sequences, dead, pieces, strict=True):
        whole = nc.compute_engram_ids(layout, tokens, np.arange(len(tokens)),
                                      [0, len(tokens)], dead_mask=flags)
        np.testing.assert_array_equal(got.reshape(whole.shape), whole)


def test_dead_token_blocks_itself_and_older_history():
    """A dead token hashes as pad with everything older; newer tokens stop at it."""
    rng = np.random.default_rng(5)
    layout = engram_cases.small_layout(rng, (3, 2, 3))
    tokens = rng.integers(0, layout.vocab_size, 6)
    dead = np.zeros(6, bool)
    dead[2] = True
    ids = nc.compute_engram_ids(layout, tokens, np.arange(6), [0, 6], dead_mask=dead)
    pad_run = nc.compute_engram_ids(layout, np.full(3, layout.config.engram_pad_token_id),
                                    np.arange(3), [0, 3])
    # Token 2 (dead) reads as pad all the way back, as a sequence of pad tokens does.
    np.testing.assert_array_equal(ids[2], pad_run[0])
    # Token 3's bigram reads [t3, pad]: as if the sequence started at token 3.
    fresh = nc.compute_engram_ids(layout, tokens[3:], np.arange(3), [0, 3])
    np.testing.assert_array_equal(ids[3:], fresh)


def test_lookback_continues_a_sequence_and_unknown_reads_pad():
    rng = np.random.default_rng(6)
    layout = engram_cases.small_layout(rng, (4, 2, 2))
    tokens = rng.integers(0, layout.vocab_size, 12)
    whole = nc.compute_engram_ids(layout, tokens, np.arange(12), [0, 12])
    lookback = tokens[7:4:-1][None, :]  # positions 7, 6, 5: newest first
    tail = nc.compute_engram_ids(layout, tokens[8:], np.arange(8, 12), [0, 4], lookback)
    np.testing.assert_array_equal(tail, whole[8:])
    # Unknown entries read the pad id without blocking what lies beyond them.
    pad = layout.config.engram_pad_token_id
    unknown = nc.compute_engram_ids(layout, tokens[8:], np.arange(8, 12), [0, 4],
                                    np.array([[-1, tokens[6], -1]]))
    known = nc.compute_engram_ids(layout, tokens[8:], np.arange(8, 12), [0, 4],
                                  np.array([[pad, tokens[6], pad]]))
    np.testing.assert_array_equal(unknown, known)


def test_torch_in_torch_out_and_out_argument():
    torch = pytest.importorskip("torch")
    layout, case = engram_cases.load_golden("synthetic")
    args, expected = engram_cases.golden_batch(case["batches"][0])
    tensors = {name: torch.from_numpy(value) for name, value in args.items()}
    ids = nc.compute_engram_ids(layout, **tensors)
    assert isinstance(ids, torch.Tensor) and ids.dtype == torch.int32
    np.testing.assert_array_equal(ids.numpy(), expected)
    out = np.empty_like(expected)
    assert nc.compute_engram_ids(layout, **args, out=out) is out
    np.testing.assert_array_equal(out, expected)


def test_advance_lookback_matches_the_reference():
    rng = np.random.default_rng(8)
    layout = engram_cases.small_layout(rng, (4, 2, 2))
    batch = engram_cases.random_batch(rng, layout, 20, 5)
    starts = batch["query_start_loc"]
    for values, old in ((batch["input_ids"], batch["lookback_token_ids"]),
                        (batch["dead_mask"], batch["lookback_dead_mask"]), (batch["input_ids"],
                                                                             None)):
        expected = reference.advance_engram_lookback(layout, values, starts,
                                                     None if old is None else old[:5])
        got = nc.advance_engram_lookback(layout, values, starts, old)
        np.testing.assert_array_equal(got, expected)
        assert got.dtype == expected.dtype


# ---------------------------------------------------------------- bad input


@pytest.fixture(scope="module")
def bad_case():
    layout, case = engram_cases.load_golden("synthetic")
    args, _ = engram_cases.golden_batch(case["batches"][0])
    return layout, args


@pytest.mark.parametrize("change, error, match", [
    (dict(input_ids=np.array([0, 1, 64] + [0] * 11)), ValueError, r"input_ids\[2\]=64"),
    (dict(input_ids=np.array([-1] + [0] * 13)), ValueError, r"input_ids\[0\]=-1"),
    (dict(lookback_token_ids=np.zeros((4, 2), np.int64)), ValueError, "lookback_token_ids must"),
    (dict(lookback_token_ids=np.zeros((3, 3), np.int64)), ValueError, "lookback_token_ids must"),
    (dict(lookback_token_ids=np.full((4, 3), -2)), ValueError, "lookback_token_ids must hold"),
    (dict(positions=np.array([0, 1, 2, 2, 4, 5, 20, 21, 22, 23, 2, 3, 4, 5])), ValueError,
     r"positions must increase within a request: positions\[3\]=2"),
    (dict(positions=np.array([0, 1, 2, 3, 4, 5, 20, 21, 22, 23, 2, 1, 4, 5])), ValueError,
     r"positions\[11\]=1 follows"),
    (dict(positions=np.arange(13)), ValueError, "one entry per token"),
    (dict(positions=-np.ones(14, np.int64)), ValueError, "non-negative"),
    (dict(dead_mask=np.zeros(14, np.int32)), TypeError, "dead_mask must be a bool"),
    (dict(dead_mask=np.zeros(13, bool)), ValueError, "dead_mask must have shape"),
    (dict(lookback_dead_mask=np.zeros((4, 2), bool)), ValueError, "lookback_dead_mask must"),
    (dict(input_ids=np.zeros(14, np.float32)), TypeError, "input_ids must be int32 or int64"),
    (dict(query_start_loc=np.array([0, 6, 6, 10, 13])), ValueError, "query_start_loc must end"),
    (dict(out=np.zeros((14, 2, 6), np.int64)), TypeError, "out must have dtype int32"),
    (dict(out=np.zeros((14, 2, 5), np.int32)), ValueError, "out must have shape"),
])
def test_bad_inputs_are_clear_errors(bad_case, change, error, match):
    layout, args = bad_case
    with pytest.raises(error, match=match):
        nc.compute_engram_ids(layout, **{**args, **change})


def test_bad_layout_and_lookback_dead_without_lookback(bad_case):
    layout, args = bad_case
    with pytest.raises(TypeError, match="layout must be an EngramLayout"):
        nc.compute_engram_ids(nc.layer_layout(nc.NGramConfig(50, 2, 1, 3, 0), 0),
                              args["input_ids"], args["positions"], args["query_start_loc"])
    without = {**args, "lookback_token_ids": None}
    with pytest.raises(ValueError, match="lookback_dead_mask needs lookback_token_ids"):
        nc.compute_engram_ids(layout, **without)
    with pytest.raises(ValueError, match="stream is only for GPU arrays"):
        nc.compute_engram_ids(layout, **args, stream=1)


@pytest.mark.parametrize("gapped, holder, where", [
    ([0, 1, 2, 3, 4, 5, 20, 21, 22, 23, 2, 3, 100, 101], 3, r"positions\[12\]=100 after "
     r"positions\[11\]=3"),
    ([5, 100, 101, 102, 103, 104, 20, 21, 22, 23, 2, 3, 4, 5], 0, r"positions\[1\]=100"),
])
def test_positions_with_a_gap_inside_a_request_are_refused(bad_case, gapped, holder, where):
    """Positions 5 then 100 in one request: the walk back by index would read tokens of another
    request (or wrap), so the CPU path and the reference refuse, naming the request."""
    layout, args = bad_case
    gapped = {**args, "positions": np.array(gapped, np.int64)}
    with pytest.raises(ValueError, match=rf"consecutive.*request {holder} has {where}"):
        nc.compute_engram_ids(layout, **gapped)
    with pytest.raises(ValueError, match=rf"request {holder}: positions must be consecutive"):
        reference.compute_engram_ids(layout, **gapped)
