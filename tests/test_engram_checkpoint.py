"""load_engram_embedding: DeepSeek's tensor names, every layer's table, head-sharded ranks."""

from __future__ import annotations

import engram_cases
import ml_dtypes
import numpy as np
import pytest

import ngram_cupy as nc
from ngram_cupy.files.engram_checkpoint import engram_head_rows
from ngram_cupy.files.safetensors_files import write_checkpoint


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The synthetic golden layout, its tables (layer 0 float32, layer 1 bfloat16) in a
    two-file checkpoint under a ``model.`` prefix, and one batch's ids."""
    layout, case = engram_cases.load_golden("synthetic")
    rng = np.random.default_rng(9)
    weights = [rng.standard_normal((rows, layout.head_dim)).astype(np.float32)
               for rows in layout.rows_per_layer]
    weights[1] = weights[1].astype(ml_dtypes.bfloat16)
    tensors = {f"model.layers.{layer_id}.engram.embed.weight": weight
               for layer_id, weight in zip(layout.layer_ids, weights, strict=True)}
    folder = tmp_path_factory.mktemp("engram_checkpoint")
    write_checkpoint(folder, {"model.embed.weight": np.zeros((2, 2), np.float32), **tensors},
                     num_files=2)
    args, ids = engram_cases.golden_batch(case["batches"][0])
    return layout, weights, folder, ids


def expected_rows(weight, ids):
    """``weight[ids]`` in float32, heads side by side."""
    return weight[ids].astype(np.float32).reshape(len(ids), -1)


def test_every_layer_loads_whole(model):
    layout, weights, folder, ids = model
    engram = nc.load_engram_embedding(folder, layout)
    for layer in range(layout.num_layers):
        np.testing.assert_array_equal(engram.forward(layer, ids, out_dtype="float32"),
                                      expected_rows(weights[layer], ids[:, layer]))


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ranks_own_whole_heads_and_sum_to_the_table(model, world_size):
    layout, weights, folder, ids = model
    ranks = [nc.load_engram_embedding(folder, layout, rank=r, world_size=world_size)
             for r in range(world_size)]
    heads, per_rank = layout.num_heads, -(-layout.num_heads // world_size)
    for layer in range(layout.num_layers):
        full = expected_rows(weights[layer], ids[:, layer]).reshape(len(ids), heads, -1)
        total = np.zeros_like(full)
        for r, engram in enumerate(ranks):
            start, stop = engram_head_rows(layout, layer, r, world_size)
            offsets = layout.head_offsets[layer]
            assert start == (offsets[r * per_rank] if r * per_rank < heads else stop)
            rows = engram.forward(layer, ids, out_dtype="float32").reshape(full.shape)
            owned = np.zeros(heads, bool)
            owned[r * per_rank:(r + 1) * per_rank] = True
            np.testing.assert_array_equal(rows[:, owned], full[:, owned])
            assert not rows[:, ~owned].any()  # other ranks' heads read zeros
            total += rows
        np.testing.assert_array_equal(total, full)


def test_checkpoint_errors(model, tmp_path):
    layout, weights, folder, _ = model
    with pytest.raises(ValueError, match=r"no layers\.11\.engram\.embed\.weight"):
        write_checkpoint(tmp_path / "one.safetensors",
                         {"layers.3.engram.embed.weight": weights[0]})
        nc.load_engram_embedding(tmp_path / "one.safetensors", layout)
    write_checkpoint(tmp_path / "short.safetensors", {
        "layers.3.engram.embed.weight": weights[0][:-1],
        "layers.11.engram.embed.weight": weights[1]})
    with pytest.raises(ValueError, match=r"has shape \[999, 32\], the config needs \[1000, 32\]"):
        nc.load_engram_embedding(tmp_path / "short.safetensors", layout)
    fp8 = {f"layers.{i}.engram.embed.weight": w.astype(np.float32).astype(
        ml_dtypes.float8_e4m3fn) for i, w in zip(layout.layer_ids, weights, strict=True)}
    fp8 |= {f"layers.{i}.engram.embed.scale": np.full((len(w), 1), 127, np.uint8)
            for i, w in zip(layout.layer_ids, weights, strict=True)}
    write_checkpoint(tmp_path / "bad_mx.safetensors", {
        **fp8, "layers.3.engram.embed.scale": np.full((1000, 2), 127, np.uint8)})
    with pytest.raises(ValueError, match=r"layers\.3\.engram\.embed\.scale must be F8_E8M0 "
                                         r"\(or U8\) of shape \[1000, 1\]"):
        nc.load_engram_embedding(tmp_path / "bad_mx.safetensors", layout)
    del fp8["layers.3.engram.embed.scale"]
    write_checkpoint(tmp_path / "unscaled.safetensors", fp8)
    with pytest.raises(ValueError, match=r"is F8_E4M3: this loader takes F32, F16, BF16 tables, "
                                         r"or F8_E4M3 with a block \.scale \(MXFP8\)"):
        nc.load_engram_embedding(tmp_path / "unscaled.safetensors", layout)
    with pytest.raises(ValueError, match=r"rank must lie in \[0, world_size=2\)"):
        nc.load_engram_embedding(folder, layout, rank=2, world_size=2)
    with pytest.raises(ValueError, match="placement must be one of"):
        nc.load_engram_embedding(folder, layout, placement="mmap")


@pytest.mark.parametrize("world_size", [1, 3])
def test_mxfp8_tables_load_in_deepseeks_dtypes(model, tmp_path, world_size):
    """DeepSeek's MXFP8 tables (SPEC 11): F8_E4M3 weights with F8_E8M0 ``.scale`` bytes, one per
    32 values, looked up exactly (the plain block reference), whole or head-sharded."""
    import torch
    from safetensors.torch import save_file

    from ngram_cupy.tables.dequant import reference_block_lookup
    from ngram_cupy.tables.formats import FORMATS, MXFP8

    layout, _, _, ids = model
    rng = np.random.default_rng(11)
    tensors, tables = {}, []
    for layer_id, rows in zip(layout.layer_ids, layout.rows_per_layer, strict=True):
        weight = rng.integers(0, 256, (rows, layout.head_dim), dtype=np.uint8)
        scales = rng.integers(100, 150, (rows, layout.head_dim // 32), dtype=np.uint8)
        tensors[f"layers.{layer_id}.engram.embed.weight"] = torch.from_numpy(weight).view(
            torch.float8_e4m3fn)
        tensors[f"layers.{layer_id}.engram.embed.scale"] = torch.from_numpy(scales).view(
            torch.float8_e8m0fnu)
        tables.append((weight, scales))
    save_file(tensors, tmp_path / "mx.safetensors")
    ranks = [nc.load_engram_embedding(tmp_path / "mx.safetensors", layout, rank=r,
                                      world_size=world_size) for r in range(world_size)]
    for layer, (weight, scales) in enumerate(tables):
        want = reference_block_lookup(FORMATS[MXFP8], weight, scales, 1.0, ids[:, layer],
                                      ml_dtypes.bfloat16)
        total = sum(engram.forward(layer, ids).astype(np.float32) for engram in ranks)
        assert ranks[0].tables[layer].format.name == "mxfp8"
        np.testing.assert_array_equal(np.isnan(total), np.isnan(want.astype(np.float32)))
        finite = ~np.isnan(total)
        np.testing.assert_array_equal(total[finite], want.astype(np.float32)[finite])
