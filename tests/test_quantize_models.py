"""Quantised tables for whole models: ``use_ngram_cupy(weight_dtype="fp8" | "nvfp4")`` on the
tiny transformers model, and ``ngram-cupy quantize`` checkpoints read back."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from test_transformers import NAMES, generated, prompts, tables, tiny_model  # noqa: E402

from ngram_cupy.transformers import use_ngram_cupy  # noqa: E402


def decoded_rows(layer) -> torch.Tensor:
    """Every row of a replaced layer's table as its lookups give them (float32)."""
    table = layer.table
    ids = np.arange(table.num_rows).reshape(-1, 1)
    return torch.from_numpy(table.lookup(ids, out_dtype=np.float32))


@pytest.mark.parametrize("weight_dtype", ["fp8", "nvfp4"])
def test_use_ngram_cupy_quantises_the_models_rows(weight_dtype):
    reference = tiny_model(torch.bfloat16)
    patched = copy.deepcopy(reference)
    use_ngram_cupy(patched, weight_dtype=weight_dtype, placement="cpu")
    layer = patched.get_submodule(NAMES[0])
    assert layer.table.format.name == ("float8_e4m3fn" if weight_dtype == "fp8" else "nvfp4")
    # The model holding the quantised rows decoded as the lookups round them: the same logits.
    same = copy.deepcopy(reference)
    with torch.no_grad():
        for weight, name in zip(tables(same), NAMES, strict=True):
            rows = patched.get_submodule(name).table.lookup(
                np.arange(weight.shape[0]).reshape(-1, 1))
            weight.copy_(torch.from_numpy(rows.view(np.int16)).view(torch.bfloat16))
    ids = prompts()
    with torch.no_grad():
        got, want, original = patched(ids).logits, same(ids).logits, reference(ids).logits
    assert torch.equal(got, want)
    # Against the bf16 model: within what the format's error moves the logits.
    error = (got.float() - original.float()).abs().max() / original.float().abs().max()
    assert error < {"fp8": 0.05, "nvfp4": 0.2}[weight_dtype], float(error)
    sequences, _ = generated(patched, ids, do_sample=False)
    assert sequences.shape == (ids.shape[0], ids.shape[1] + 6)
