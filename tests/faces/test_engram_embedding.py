"""EngramEmbedding: one ids launch for all layers, prefetch of every layer, per-layer lookups."""

from __future__ import annotations

import engram_cases
import numpy as np
import pytest

import ngram_cupy as nc


@pytest.fixture(scope="module")
def model():
    layout, case = engram_cases.load_golden("synthetic")
    rng = np.random.default_rng(3)
    weights = [rng.standard_normal((rows, layout.head_dim)).astype(np.float32)
               for rows in layout.rows_per_layer]
    args, expected = engram_cases.golden_batch(case["batches"][0])
    return layout, weights, args, expected


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_step_then_layers_equal_the_rows_of_the_ids(model, dtype):
    layout, weights, args, expected = model
    # bfloat16 tables hold the top half of each float32's bits.
    tables = [nc.EmbeddingTable(w) if dtype == "float32" else
              nc.EmbeddingTable((w.view(np.uint32) >> 16).astype(np.uint16), dtype="bfloat16")
              for w in weights]
    engram = nc.EngramEmbedding(layout, tables)
    ids = engram.start_step(**args)
    np.testing.assert_array_equal(ids, expected)
    for layer in reversed(range(layout.num_layers)):  # any order joins its own prefetch
        rows = engram.forward(layer, out_dtype="float32")
        plain = tables[layer].lookup(expected[:, layer].copy(), out_dtype="float32")
        np.testing.assert_array_equal(rows, plain)
        if dtype == "float32":
            wanted = weights[layer][expected[:, layer]].reshape(len(expected), -1)
            np.testing.assert_array_equal(rows, wanted)
    # Explicit ids, without a step's prefetch.
    np.testing.assert_array_equal(engram(0, ids, out_dtype="float32"),
                                  tables[0].lookup(expected[:, 0].copy(), out_dtype="float32"))


def test_bad_tables_and_layers(model):
    layout, weights, args, _ = model
    tables = [nc.EmbeddingTable(w) for w in weights]
    with pytest.raises(ValueError, match="one table per Engram layer"):
        nc.EngramEmbedding(layout, tables[:1])
    with pytest.raises(ValueError, match=r"tables\[1\].total_rows=.* must equal "
                                         r"engram_num_embeddings\[1\]"):
        nc.EngramEmbedding(layout, [tables[0], tables[0]])
    with pytest.raises(ValueError, match="head_dim"):
        nc.EngramEmbedding(layout, [nc.EmbeddingTable(w[:, :16].copy()) for w in weights])
    with pytest.raises(TypeError, match=r"tables\[0\] must be an EmbeddingTable"):
        nc.EngramEmbedding(layout, weights)
    engram = nc.EngramEmbedding(layout, tables)
    with pytest.raises(ValueError, match="call start_step first"):
        engram.forward(0)
    with pytest.raises(ValueError, match=r"layer must lie in \[0, 2\)"):
        engram.forward(2, np.zeros((1, 2, 6), np.int32))
    with pytest.raises(ValueError, match="ids must have shape"):
        engram.forward(0, np.zeros((1, 6), np.int32))
    with pytest.raises(TypeError, match=r"ids must be an array \[T, L, H\].*got list"):
        engram.forward(0, [[[1] * 6] * 2])
