"""Cases of the fourth hostile trial: block-scaled rows, scales, configs and caches that used to
give a silent wrong answer or an unclear error."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_same

import ngram_cupy as nc
from ngram_cupy.codecs.dequant import reference_block_lookup
from ngram_cupy.formats import FORMATS, MXFP8, NVFP4

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


def mxfp8_checkpoint(folder, dtype_in_config):
    """An NVFP4 checkpoint rewritten with MXFP8's stored names and dtypes: F8_E4M3 shards and
    F8_E8M0 ``shard_i.weight_scale``, no global scale."""
    import json

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    config = nc.NGramConfig(1000, 3, 2, 100, 5, embedding_dim=4 * 32, split_ngram_parts=3,
                            ple_embedding_dtype="nvfp4")
    layout = nc.layer_layout(config, 0)
    rng = np.random.default_rng(2)
    weight = rng.integers(0, 256, (layout.padded_rows, layout.head_dim // 2), dtype=np.uint8)
    scales = rng.integers(1, 0x7F, (layout.padded_rows, layout.head_dim // 16), dtype=np.uint8)
    files = nc.save_ngram_embedding(folder, config, 0, weight, scale=np.float32(1.0),
                                    block_scales=scales.view(FORMATS[NVFP4].block_scale))
    for file in files:
        with safe_open(file, "pt") as opened:
            metadata = opened.metadata()
        tensors = load_file(file)
        for name in list(tensors):
            rows = tensors[name].shape[0] if tensors[name].ndim else 0
            if name.endswith(".weight_scale_2"):
                del tensors[name]
            elif ".shard_" in name and name.endswith(".weight"):
                tensors[name] = torch.zeros((rows, layout.head_dim), dtype=torch.float8_e4m3fn)
            elif ".shard_" in name and name.endswith(".weight_scale"):
                tensors[name] = torch.full((rows, layout.head_dim // 32), 127,
                                           dtype=torch.uint8).view(torch.float8_e8m0fnu)
        save_file(tensors, file, metadata=metadata)
    hf = json.loads((folder / "config.json").read_text())
    text = hf.get("text_config", hf)
    text.pop("ple_embedding_dtype", None)
    if dtype_in_config:
        text["ple_embedding_dtype"] = "mxfp8"
    (folder / "config.json").write_text(json.dumps(hf))
    return nc.NGramConfig.from_hf(folder)


@pytest.mark.parametrize("dtype_in_config", [True, False])
def test_an_mxfp8_checkpoint_is_named_mxfp8_not_nvfp4(tmp_path, dtype_in_config):
    config = mxfp8_checkpoint(tmp_path, dtype_in_config)
    with pytest.raises(ValueError, match="holds an MXFP8 table") as error:
        nc.load_ngram_embedding(tmp_path, config, 0, placement="cpu")
    assert "NVFP4" not in str(error.value) and "packed" not in str(error.value)


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "nvfp4"])
@pytest.mark.parametrize("scale", [0.0, -1.0, -0.0])
def test_in_memory_tables_refuse_the_scales_the_loaders_refuse(dtype, scale):
    """Scale 0 reads as an all-zero table and -1 flips every sign: refused as the loaders do."""
    head_dim = 32
    width = head_dim // 2 if dtype == "nvfp4" else head_dim
    weight = np.ones((4, width), np.uint8)
    scales = np.ones((4, head_dim // 16), np.uint8) if dtype == "nvfp4" else None
    with pytest.raises(ValueError, match="scale must be a finite positive number"):
        nc.EmbeddingTable(weight, scale=scale, dtype=dtype, block_scales=scales)
    with pytest.raises(ValueError, match="scale must be a finite positive number"):
        nc.EmbeddingTable.empty(4, head_dim, dtype, scale=scale)


@pytest.mark.parametrize("reader", [nc.NGramConfig.from_hf, nc.EngramConfig.from_hf])
def test_a_config_that_is_not_utf8_names_the_file(tmp_path, reader):
    path = tmp_path / "config.json"
    path.write_bytes(b'{"vocab_size": 1000, "name": "\xff\xfe"}')
    with pytest.raises(ValueError, match=rf"config file {path} is not UTF-8 text: byte 30 "):
        reader(tmp_path)


def test_a_config_that_is_not_an_object_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"config.json must hold a JSON object, got list"):
        nc.NGramConfig.from_hf(tmp_path)
    (tmp_path / "inner").mkdir()
    (tmp_path / "inner" / "config.json").mkdir()
    with pytest.raises(ValueError, match=r"config.json is a folder, not a file"):
        nc.EngramConfig.from_hf(tmp_path / "inner")


def test_an_mxfp8_module_loads_ue8m0_block_scales_and_refuses_a_global_scale():
    """vLLM's MXFP8 names: shard rows (E4M3) and UE8M0 ``shard_i.weight_scale`` load as the
    table's rows; a global scale (NVFP4's) would be ignored, so it is refused."""
    module, fmt, weight, scales = block_scaled_module("mxfp8", seed=3)
    fresh, _, _, _ = block_scaled_module("mxfp8", seed=4)
    stop = module.layout.padded_rows // 3
    rows = torch.from_numpy(weight[:stop].view(np.uint8)).view(torch.float8_e4m3fn)
    ue8m0 = torch.from_numpy(scales[:stop]).view(torch.float8_e8m0fnu)
    fresh.load_weights([("ngram_embedding.shard_0.weight", rows),
                        ("ngram_embedding.shard_0.weight_scale", ue8m0)])
    ids = np.arange(stop).reshape(-1, 1)
    assert_same(fresh.table.lookup(ids, out_dtype=np.float32),
                module.table.lookup(ids, out_dtype=np.float32))
    with pytest.raises(ValueError, match="unexpected weight 'ngram_embedding.weight_scale_2'"):
        fresh.load_weights([("ngram_embedding.weight_scale_2", torch.tensor(2.0))])


def test_layout_gives_no_bytes_for_formats_that_cannot_hold_the_head_dim(tmp_path, capsys):
    """head_dim 40: no NVFP4 (16-value blocks) or MXFP8 (32) table exists, so no figure."""
    from ngram_cupy.cli.main import main
    from ngram_cupy.files.config_json import write_config_json

    write_config_json(tmp_path, nc.NGramConfig(1000, 3, 2, 100, 5, embedding_dim=4 * 40))
    assert main(["layout", "--config", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "float8_e4m3fn" in out and "(40 B per row in memory, 40 B in a checkpoint)" in out
    for name, unit in (("nvfp4", 16), ("mxfp8", 32)):
        line = next(line for line in out.splitlines() if line.split()[:1] == [name])
        assert f"head_dim 40 is not a multiple of {unit}" in line and "B per row" not in line
