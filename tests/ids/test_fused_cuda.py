"""The fused kernel's load width (bug 1): chosen from the row size and the table's address."""

from __future__ import annotations

import numpy as np
import pytest

from ngram_cupy.ids import fused_cuda


@pytest.mark.parametrize("row_bytes, itemsize, address, width", [
    (16, 1, 0, 8), (16, 1, 1, 1), (16, 1, 2, 2), (16, 1, 4, 4), (16, 2, 6, 2), (16, 4, 12, 4),
    (12, 4, 8, 4), (6, 2, 0, 2), (320, 2, 0x7F0000000008, 8), (320, 2, 0x7F0000000002, 2),
])
def test_word_width_divides_the_row_and_the_address(row_bytes, itemsize, address, width):
    assert fused_cuda.word_bytes(row_bytes, itemsize, address) == width


@pytest.mark.parametrize("offset, dtype, width", [(0, np.uint8, 8), (1, np.uint8, 1),
                                                  (2, np.uint16, 2), (4, np.uint32, 4)])
def test_a_table_viewed_at_an_odd_address_is_read_in_narrower_words(offset, dtype, width):
    """An adopted view offset from an 8-byte boundary (CuPy's ``.view()`` keeps any address):
    8-byte loads would fault on hardware; the words must shrink to the address's alignment."""
    base = np.zeros(64 * 4 + 16, np.uint8)
    start = -base.ctypes.data % 16 + offset
    table = base[start : start + 64 * 4].view(dtype).reshape(8, -1)  # rows of 32 bytes
    assert table.ctypes.data % 16 == offset
    words = fused_cuda.table_words(table, np.dtype(dtype).itemsize)
    assert words.dtype.itemsize == width and words.ctypes.data == table.ctypes.data
    assert words.shape == (8, 32 // width)
