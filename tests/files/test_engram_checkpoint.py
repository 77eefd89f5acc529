"""load_engram_embedding: DeepSeek's tensor names, every layer's table (float and MXFP8, in every
placement), head-sharded ranks, and the checks on each tensor."""

from __future__ import annotations

import dataclasses

import engram_cases
import ml_dtypes
import numpy as np
import pytest

import ngram_cupy as nc
from ngram_cupy.files.engram_checkpoint import engram_head_rows
from ngram_cupy.files.safetensors_files import Checkpoint, write_checkpoint
from ngram_cupy.hashing.token_map import TokenMap


@pytest.fixture(scope="module")
def checkpoint_model(tmp_path_factory):
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


def weight_rows(weight, ids):
    """``weight[ids]`` in float32, heads side by side."""
    return weight[ids].astype(np.float32).reshape(len(ids), -1)


@pytest.mark.parametrize("placement", ["cpu", "pinned", "mmap", "shared"])
def test_every_layer_loads_whole(checkpoint_model, placement, shm_dir):
    layout, weights, folder, ids = checkpoint_model
    engram = nc.load_engram_embedding(folder, layout, placement=placement)
    for layer in range(layout.num_layers):
        np.testing.assert_array_equal(engram.forward(layer, ids, out_dtype="float32"),
                                      weight_rows(weights[layer], ids[:, layer]))


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ranks_own_whole_heads_and_sum_to_the_table(checkpoint_model, world_size):
    layout, weights, folder, ids = checkpoint_model
    ranks = [nc.load_engram_embedding(folder, layout, rank=r, world_size=world_size)
             for r in range(world_size)]
    heads, per_rank = layout.num_heads, -(-layout.num_heads // world_size)
    for layer in range(layout.num_layers):
        full = weight_rows(weights[layer], ids[:, layer]).reshape(len(ids), heads, -1)
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
    del ranks  # their shared segments go with them


def test_checkpoint_errors(checkpoint_model, tmp_path):
    layout, weights, folder, _ = checkpoint_model
    with pytest.raises(ValueError, match=r"no layers\.11\.engram\.embed\.weight"):
        write_checkpoint(tmp_path / "one.safetensors",
                         {"layers.3.engram.embed.weight": weights[0]})
        nc.load_engram_embedding(tmp_path / "one.safetensors", layout)
    write_checkpoint(tmp_path / "short.safetensors", {
        "layers.3.engram.embed.weight": weights[0][:-1],
        "layers.11.engram.embed.weight": weights[1]})
    with pytest.raises(ValueError, match=r"has shape \[999, 32\], the config needs \[1000, 32\]"):
        nc.load_engram_embedding(tmp_path / "short.safetensors", layout)
    with pytest.raises(ValueError, match=r"rank must lie in \[0, world_size=2\)"):
        nc.load_engram_embedding(folder, layout, rank=2, world_size=2)
    with pytest.raises(ValueError, match="placement must be one of"):
        nc.load_engram_embedding(folder, layout, placement="disk")


def mxfp8_reference(weight: np.ndarray, scales: np.ndarray, ids: np.ndarray,
                    out_dtype=ml_dtypes.bfloat16) -> np.ndarray:
    """SPEC 11's decode, written plainly: ``out(f32(e4m3) * S)`` with ``S`` the float32 of bits
    ``byte << 23`` (byte 0: 0.0, 255: +inf), one scale per 32 values; heads side by side."""
    s = (scales.astype(np.uint32) << 23).view(np.float32)
    with np.errstate(invalid="ignore"):  # 0 * inf: NaN, as on the engines
        values = weight.astype(np.float32) * np.repeat(s, 32, axis=1)
    return values.astype(out_dtype)[ids].reshape(len(ids), -1)


def assert_bits(got, want):
    """Equal bits, NaNs (e4m3 zero times an infinite scale) as a class."""
    got, want = np.asarray(got).view(want.dtype), np.asarray(want)
    nan = np.isnan(want.astype(np.float32))
    np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan)
    raw = np.dtype(f"u{want.dtype.itemsize}")
    np.testing.assert_array_equal(got.view(raw)[~nan], want.view(raw)[~nan])


@pytest.fixture(scope="module")
def mxfp8_model(tmp_path_factory):
    """The golden layout's tables as MXFP8 (random non-NaN E4M3 bytes, UE8M0 bytes over their
    whole range with 0 and 255 in every layer), saved by ``save_engram_embedding`` in DeepSeek's
    names in two files, and one batch's ids."""
    layout, case = engram_cases.load_golden("synthetic")
    rng = np.random.default_rng(22)
    weights, scales = [], []
    for rows in layout.rows_per_layer:
        codes = rng.integers(0, 256, (rows, layout.head_dim), dtype=np.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0x38  # no NaN codes: 1.0
        weights.append(codes.view(ml_dtypes.float8_e4m3fn))
        blocks = rng.integers(100, 150, (rows, layout.head_dim // 32)).astype(np.uint8)
        blocks[:3] = rng.integers(0, 256, (3, blocks.shape[1]))
        blocks[0, 0], blocks[1, 0] = 0, 255
        scales.append(blocks)
    folder = tmp_path_factory.mktemp("engram_mxfp8")
    nc.save_engram_embedding(folder, layout, weights, scales, num_files=2)
    args, ids = engram_cases.golden_batch(case["batches"][0])
    ids[0, :, 0] = 0  # the rows with scale bytes 0 and 255 are read
    ids[1, :, 0] = 1
    return layout, weights, scales, folder, ids


def test_the_writer_uses_deepseeks_names_and_dtypes(mxfp8_model):
    layout, weights, scales, folder, _ = mxfp8_model
    checkpoint = Checkpoint.open(folder)
    for layer_id, weight, blocks in zip(layout.layer_ids, weights, scales, strict=True):
        name = f"model.layers.{layer_id}.engram.embed."
        assert checkpoint.info(name + "weight").dtype == "F8_E4M3"
        info = checkpoint.info(name + "scale")
        assert (info.dtype, info.shape) == ("F8_E8M0", blocks.shape)
        np.testing.assert_array_equal(checkpoint.read(name + "scale"), blocks)
        np.testing.assert_array_equal(checkpoint.read(name + "weight").view(np.uint8),
                                      weight.view(np.uint8))


@pytest.mark.parametrize("placement", ["cpu", "pinned", "mmap"])
def test_mxfp8_tables_load_bit_exact(mxfp8_model, placement):
    layout, weights, scales, folder, ids = mxfp8_model
    engram = nc.load_engram_embedding(folder, layout, placement=placement)
    for layer in range(layout.num_layers):
        for out_dtype in (ml_dtypes.bfloat16, np.float32):
            want = mxfp8_reference(weights[layer], scales[layer], ids[:, layer], out_dtype)
            got = engram.forward(layer, ids, out_dtype=np.dtype(out_dtype).name)
            assert_bits(got, want)
        assert np.isinf(want[1, :32]).any()  # the 255 scale byte was read as +inf


@pytest.mark.parametrize("placement", ["cpu", "mmap"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_mxfp8_ranks_own_whole_heads(mxfp8_model, placement, world_size):
    layout, weights, scales, folder, ids = mxfp8_model
    heads, per_rank = layout.num_heads, -(-layout.num_heads // world_size)
    for r in range(world_size):
        engram = nc.load_engram_embedding(folder, layout, placement, r, world_size)
        for layer in range(layout.num_layers):
            want = mxfp8_reference(weights[layer], scales[layer], ids[:, layer])
            want = want.reshape(len(ids), heads, -1)
            rows = np.asarray(engram.forward(layer, ids, out_dtype="bfloat16")).reshape(
                want.shape)
            owned = np.zeros(heads, bool)
            owned[r * per_rank:(r + 1) * per_rank] = True
            assert_bits(rows[:, owned], want[:, owned])
            assert not rows[:, ~owned].view(np.uint16).any()  # +0.0 for the others' heads


def mx_tensors(layout, weights, scales):
    """DeepSeek's tensors of an MXFP8 checkpoint, by name (no prefix)."""
    tensors = {}
    for layer_id, weight, blocks in zip(layout.layer_ids, weights, scales, strict=True):
        tensors[f"layers.{layer_id}.engram.embed.weight"] = weight
        tensors[f"layers.{layer_id}.engram.embed.scale"] = blocks.view(ml_dtypes.float8_e8m0fnu)
    return tensors


@pytest.mark.parametrize("change, match", [
    (lambda t: t.update({"layers.3.engram.embed.scale": t["layers.3.engram.embed.scale"][:, :0]}),
     r"layers\.3\.engram\.embed\.scale must be F8_E8M0 of shape \[1000, 1\].*shape \[1000, 0\]"),
    (lambda t: t.update({"layers.11.engram.embed.scale": t["layers.11.engram.embed.scale"].view(
        np.uint8)}), r"layers\.11\.engram\.embed\.scale must be F8_E8M0 .* got U8"),
    (lambda t: t.pop("layers.3.engram.embed.scale"),
     r"layers\.3\.engram\.embed\.weight is F8_E4M3 but its block scales "
     r"layers\.3\.engram\.embed\.scale \(F8_E8M0\) are missing"),
    (lambda t: t.update({"layers.11.engram.embed.weight": t["layers.11.engram.embed.weight"].astype(
        np.float32)}), r"layers\.11\.engram\.embed\.weight is F32 with a block \.scale"),
])
def test_bad_mxfp8_checkpoints_name_the_tensor(mxfp8_model, tmp_path, change, match):
    layout, weights, scales, _, _ = mxfp8_model
    tensors = mx_tensors(layout, weights, scales)
    change(tensors)
    write_checkpoint(tmp_path / "bad.safetensors", tensors)
    with pytest.raises(ValueError, match=match):
        nc.load_engram_embedding(tmp_path / "bad.safetensors", layout)


def test_mxfp8_needs_whole_blocks_and_no_shared_placement(mxfp8_model, tmp_path):
    layout, weights, scales, folder, _ = mxfp8_model
    with pytest.raises(ValueError, match=r"weight: placement='shared' holds tables of one"):
        nc.load_engram_embedding(folder, layout, placement="shared")
    tokens = TokenMap(layout.token_map, layout.config.engram_compressed_vocab_size, "narrow")
    narrow = nc.engram_layout(dataclasses.replace(layout.config, engram_head_dim=16), tokens)
    tensors = mx_tensors(narrow, [w[:, :16] for w in weights], [b[:, :1] for b in scales])
    write_checkpoint(tmp_path / "narrow.safetensors", tensors)
    with pytest.raises(ValueError, match=r"layers\.3\.engram\.embed\.weight: MXFP8 tables need "
                                         r"engram_head_dim a multiple of 32, got 16"):
        nc.load_engram_embedding(tmp_path / "narrow.safetensors", narrow)
    with pytest.raises(ValueError, match=r"weights\[0\] must be float8_e4m3fn with block_scales"):
        nc.save_engram_embedding(tmp_path / "x.safetensors", layout,
                                 [w.astype(np.float32) for w in weights], scales)
    with pytest.raises(ValueError, match="block_scales must have shape"):
        nc.save_engram_embedding(tmp_path / "x.safetensors", layout, weights,
                                 [b[:, :0] for b in scales])
    assert not (tmp_path / "x.safetensors").exists()  # nothing written on error
