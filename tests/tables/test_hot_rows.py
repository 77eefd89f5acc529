"""The hot-row slot map: every row's slot is its rank among the hot rows, or -1 when cold."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import njit

from ngram_cupy.tables.hot_rows import build_map, check_hot_rows, hot_slot, map_nbytes, popcount


@njit
def slots_compiled(words, ranks, num_rows):
    """``hot_slot`` of every local row, compiled by Numba."""
    out = np.empty(num_rows, np.int64)
    for local in range(num_rows):
        out[local] = hot_slot(words, ranks, local)
    return out


def expected_slots(hot_rows, row_start, num_rows):
    """The definition: slot s for hot_rows[s], -1 elsewhere."""
    slots = np.full(num_rows, -1, np.int64)
    slots[hot_rows - row_start] = np.arange(hot_rows.size)
    return slots


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 300), st.integers(0, 1000), st.data())
def test_slots_are_ranks(num_rows, row_start, data):
    chosen = data.draw(st.sets(st.integers(0, max(num_rows - 1, 0)), max_size=num_rows))
    hot = np.array(sorted(chosen), dtype=np.int64)[: num_rows] + row_start
    hot_map = build_map(check_hot_rows(hot, row_start, num_rows), row_start, num_rows)
    assert hot_map.words.size == hot_map.ranks.size == -(-num_rows // 64)
    assert hot_map.nbytes == map_nbytes(num_rows)
    want = expected_slots(hot, row_start, num_rows)
    np.testing.assert_array_equal(slots_compiled(*hot_map, num_rows), want)
    with warnings.catch_warnings():  # the simulator's path: plain Python on NumPy scalars
        warnings.simplefilter("error", RuntimeWarning)
        plain = [hot_slot(hot_map.words, hot_map.ranks, np.int64(i)) for i in range(num_rows)]
    np.testing.assert_array_equal(np.array(plain, dtype=np.int64).reshape(-1), want)


def test_every_bit_of_a_word():
    hot = np.arange(0, 192, dtype=np.int64)  # three full words, then one bit per word
    hot = np.concatenate([hot, [255, 256, 319, 320 + 63]])
    hot_map = build_map(check_hot_rows(hot, 0, 400), 0, 400)
    assert list(hot_map.ranks) == [0, 64, 128, 192, 193, 195, 196]
    np.testing.assert_array_equal(slots_compiled(*hot_map, 400), expected_slots(hot, 0, 400))


@pytest.mark.parametrize("bits", [0, 1, 0x8000000000000000, 0xFFFFFFFFFFFFFFFF,
                                  0x5555555555555555, 0x0123456789ABCDEF])
def test_popcount(bits):
    assert popcount(np.uint64(bits)) == bin(bits).count("1")


@pytest.mark.parametrize("hot_rows, message", [
    ([3, 2], "sorted and unique"),
    ([2, 2], "sorted and unique"),
    ([9], r"within the table's rows \[10, 20\), got 9"),
    ([10, 20], r"within the table's rows \[10, 20\), got 20"),
    ([[10]], "1-D"),
])
def test_bad_hot_rows(hot_rows, message):
    with pytest.raises(ValueError, match=message):
        check_hot_rows(np.array(hot_rows, dtype=np.int64), 10, 10)


def test_hot_rows_types():
    with pytest.raises(TypeError, match="hot_rows must hold integer"):
        check_hot_rows(np.array([10.0]), 10, 10)
    assert check_hot_rows([], 0, 5).dtype == np.int64
    np.testing.assert_array_equal(check_hot_rows(np.array([1, 4], np.uint32), 0, 5), [1, 4])


def test_the_cuda_slot_is_one_popc(monkeypatch):
    """``hot_slot`` compiled by Numba CUDA (no GPU needed): the count is one ``popc.b64``."""
    from numba import cuda, types

    monkeypatch.setattr(cuda.dispatcher, "get_current_device",
                        lambda: type("Device", (), {"compute_capability": (9, 0)}))

    def kernel(words, ranks, ids, out):
        i = cuda.grid(1)
        if i < ids.shape[0]:
            out[i] = hot_slot(words, ranks, ids[i])

    vector = lambda dtype: types.Array(dtype, 1, "C")  # noqa: E731
    ptx, _ = cuda.compile_ptx(kernel, (vector(types.uint64), vector(types.uint32),
                                       vector(types.int64), vector(types.int64)), cc=(9, 0))
    assert "popc.b64" in ptx
