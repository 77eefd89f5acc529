"""Quantising extreme values (issue 43): a table whose amax is subnormal gets a positive scale
that ``EmbeddingTable`` takes, and MXFP8 blocks near FLT_MAX decode to finite values (the
nearest finite one), bitwise the same on the array path."""

from __future__ import annotations

import numpy as np
import pytest

import ngram_cupy as nc
from ngram_cupy.codecs.quantize_cupy import ArrayEngine

FLT_MAX = np.finfo(np.float32).max
TINY = np.finfo(np.float32).smallest_subnormal


@pytest.mark.parametrize("to", ["fp8", "nvfp4"])
def test_a_subnormal_amax_gets_a_positive_scale(to):
    source = np.zeros((3, 32), np.float32)
    source[1, :4] = [TINY * 5, -TINY * 3, TINY, 0]
    q = nc.quantize_table(source, to)
    assert q.scale == TINY
    table = nc.EmbeddingTable(q)
    decoded = table.lookup(np.arange(3).reshape(-1, 1), out_dtype=np.float32)
    assert np.isfinite(decoded).all()
    if to == "fp8":  # 5, -3 and 1 units of the scale: exact codes
        assert decoded[1, :4].tolist() == source[1, :4].tolist()


def test_mxfp8_values_near_float32s_largest_decode_finite():
    source = np.zeros((2, 64), np.float32)
    source[0, :5] = [FLT_MAX, -FLT_MAX, np.float32(1.8 * 2.0**127), np.float32(1.76 * 2.0**127),
                     1.0]
    source[1, 32:34] = [np.float32(1.75 * 2.0**127), np.float32(2.0**127)]  # scale 2**119
    q = nc.quantize_table(source, "mxfp8")
    decoded = nc.EmbeddingTable(q).lookup(np.arange(2).reshape(-1, 1), out_dtype=np.float32)
    assert np.isfinite(decoded).all()
    top = np.float32(240 * 2.0**120)  # the largest finite value of that block's scale
    below = np.float32(224 * 2.0**120)  # 1.8 and 1.76 * 2**127 round to nearest
    assert decoded[0, :4].tolist() == [top, -top, below, below]
    assert decoded[1, 32:34].tolist() == source[1, 32:34].tolist()
    engine = ArrayEngine(np)
    out = np.empty(q.weight.shape, np.uint8)
    blocks = np.empty(q.block_scales.shape, np.uint8)
    engine.mxfp8(source, None, out, blocks)
    assert np.array_equal(out, q.weight.view(np.uint8))
    assert np.array_equal(blocks, q.block_scales.view(np.uint8))
