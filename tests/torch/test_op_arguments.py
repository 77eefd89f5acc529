"""The registered ops (``torch.ops.ngram_cupy.*``) called directly with malformed arguments: each
is the op's own TypeError / ValueError naming the argument, before anything is done (never an
IndexError, a reshape error, or a write into the table)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ngram_cupy as nc
from ngram_cupy.torch import NGramEmbeddingModule, fused_optimizer

CONFIG = nc.NGramConfig(vocab_size=50, ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=11,
                        eos_token_id=0, embedding_dim=8)
LAYOUT = nc.layer_layout(CONFIG, 0)
HEADS, DIM = LAYOUT.num_heads, LAYOUT.head_dim
OPS = torch.ops.ngram_cupy
IDS = torch.zeros((3, HEADS), dtype=torch.int64)
GRAD = torch.zeros((3, HEADS * DIM))
INTS = torch.ones(4, dtype=torch.int64)


def table_alias(layer) -> torch.Tensor:
    """An ``out`` for ``IDS`` that is the table's own first rows."""
    return layer.ngram_embedding.weight.detach().view(-1)[:3 * HEADS * DIM].view(3, HEADS * DIM)


# (op, arguments after the handle (from the layer), error, message)
CASES = [
    ("ngram_ids", lambda layer: (torch.ones(4), torch.tensor([0, 4]), None), TypeError,
     "input_ids must be an integer tensor"),
    ("ngram_ids", lambda layer: (torch.ones((1, 2, 2), dtype=torch.int64), None, None),
     ValueError, "input_ids must be 1-D or 2-D"),
    ("ngram_ids", lambda layer: (INTS, torch.tensor([[0, 4]]), torch.zeros((1, 2), dtype=int)),
     ValueError, "query_start_loc must be 1-D"),
    ("ngram_ids", lambda layer: (INTS, torch.tensor([0, 4]), torch.zeros(2, dtype=torch.int64)),
     ValueError, "ngram_context must be 2-D"),
    ("lookup_", lambda layer: (torch.zeros(3, dtype=torch.int64), torch.empty(3, HEADS * DIM)),
     ValueError, "ids must be 2-D or more"),
    ("lookup_", lambda layer: (IDS, torch.empty(3, 5)), ValueError, "out must have shape"),
    ("lookup_", lambda layer: (IDS, table_alias(layer)), ValueError,
     "out shares memory with the table"),
    ("prefetch_", lambda layer: (IDS.float(), torch.empty(3, HEADS * DIM)), TypeError,
     "ids must be int32 or int64"),
    ("dequantize", lambda layer: (torch.tensor(1.0), None, torch.float32), ValueError,
     "rows must have a last dimension of whole rows"),
    ("dequantize", lambda layer: (torch.zeros(2, DIM, dtype=torch.int32), None, torch.float32),
     TypeError, "rows must be the table's stored rows"),
    ("dequantize", lambda layer: (torch.zeros(2, 3), None, torch.float32), ValueError,
     "rows must have a last dimension of whole rows"),
    ("dequantize", lambda layer: (torch.zeros(2, DIM), torch.zeros(2, 1), torch.float32),
     ValueError, "block_scales are only for block-scaled tables"),
    ("trainable_lookup", lambda layer: (layer.ngram_embedding.weight, IDS[:, 0], torch.float32,
                                        False), ValueError, "ids must be 2-D"),
    ("trainable_lookup", lambda layer: (layer.ngram_embedding.weight, IDS[:, :1], torch.float32,
                                        False), ValueError, rf"ids must be \[T, {HEADS}\]"),
    ("trainable_lookup", lambda layer: (torch.zeros(2), IDS, torch.float32, False), ValueError,
     "weight must be the layer's weight"),
    ("row_gradient", lambda layer: (IDS.float(), GRAD), TypeError,
     "ids must be an integer tensor"),
    ("row_gradient", lambda layer: (IDS, torch.tensor(1.0)), ValueError,
     r"grad_out must be \[3, "),
    ("row_gradient", lambda layer: (IDS, GRAD.int()), TypeError,
     "grad_out must be a floating tensor"),
    ("optimizer_step_", lambda layer: (IDS.reshape(-1), GRAD, layer.ngram_embedding.weight),
     ValueError, "ids must be 2-D"),
    ("optimizer_step_", lambda layer: (IDS, GRAD[:, :5], layer.ngram_embedding.weight),
     ValueError, r"grad_out must be \[3, "),
    ("optimizer_step_", lambda layer: (IDS, GRAD, torch.zeros(2)), ValueError,
     "weight must be the layer's weight"),
]


@pytest.fixture(scope="module")
def layer():
    layer = NGramEmbeddingModule(CONFIG, 0, placement="cpu", trainable=True)
    rows = np.random.default_rng(0).standard_normal((LAYOUT.padded_rows, DIM))
    layer.load_weights([("ngram_embedding.weight", torch.from_numpy(rows.astype(np.float32)))])
    return layer


@pytest.mark.parametrize("op, arguments, error, message", CASES,
                         ids=[f"{case[0]}-{number}" for number, case in enumerate(CASES)])
def test_a_malformed_argument_is_named(layer, op, arguments, error, message):
    before = layer.table.host_view.copy()
    layer.trainable_rows.optimizer = None
    if op == "optimizer_step_":
        fused_optimizer(layer, "sgd", lr=1.0)
    with pytest.raises(error, match=message):
        getattr(OPS, op)(layer.handle, *arguments(layer))
    assert np.array_equal(layer.table.host_view, before)  # nothing written
