"""Cases of the fourth hostile trial: block-scaled rows, scales, configs and caches that used to
give a silent wrong answer or an unclear error."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_same

import ngram_cupy as nc
from ngram_cupy.tables.dequant import reference_block_lookup
from ngram_cupy.tables.formats import FORMATS, MXFP8, NVFP4

torch = pytest.importorskip("torch")

CONFIG = nc.NGramConfig(1000, 3, 2, 100, 5, embedding_dim=4 * 32, split_ngram_parts=3)


def block_scaled_module(name: str, seed: int = 0):
    """A CPU module of ``name`` rows filled with random stored values and block scales."""
    from ngram_cupy.torch import NGramEmbeddingModule

    fmt = FORMATS[{"nvfp4": NVFP4, "mxfp8": MXFP8}[name]]
    module = NGramEmbeddingModule(CONFIG, 0, placement="cpu", weight_dtype=name)
    rng = np.random.default_rng(seed)
    rows, head_dim = module.layout.padded_rows, module.layout.head_dim
    if name == "nvfp4":
        weight = rng.integers(0, 256, (rows, head_dim // 2), dtype=np.uint8)
        scales = rng.integers(1, 0x7F, (rows, head_dim // fmt.block), dtype=np.uint8)
    else:
        weight = rng.integers(0, 0x7F, (rows, head_dim), dtype=np.uint8).view(fmt.dtype)
        scales = rng.integers(120, 135, (rows, head_dim // fmt.block), dtype=np.uint8)
    module.table.write_rows(0, weight, scales)
    return module, fmt, weight, scales


@pytest.mark.parametrize("name", ["mxfp8", "nvfp4"])
def test_dequantize_of_block_scaled_stored_rows_needs_and_uses_their_scales(name):
    """The table's own stored rows decode with their block scales (not as plain float8), and
    without them dequantize refuses rather than ignoring them."""
    module, fmt, weight, scales = block_scaled_module(name)
    ids = np.array([[3], [0], [7]])
    stored = torch.from_numpy(weight[ids[:, 0]].view(np.uint8)).view(fmt.torch_dtype)
    with pytest.raises(ValueError, match=f"stored {name} rows need their block_scales"):
        module.dequantize(stored, torch.float32)
    got = module.dequantize(stored, torch.float32,
                            block_scales=torch.from_numpy(scales[ids[:, 0]]))
    scale = 1.0 if name == "mxfp8" else module.table.scale
    want = reference_block_lookup(fmt, weight, scales, scale, ids, np.float32)
    assert_same(got.numpy(), want)
