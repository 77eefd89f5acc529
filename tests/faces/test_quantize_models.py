"""Quantised tables for whole models: ``use_ngram_cupy(weight_dtype="fp8" | "nvfp4")`` on the
tiny transformers model, and ``ngram-cupy quantize`` checkpoints read back."""

from __future__ import annotations

import copy
import json
import os
import time

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from test_transformers import (  # noqa: E402
    NAMES,
    generated,
    ple_tables,
    prompts,
    tiny_config,
    tiny_model,
)
from transformers import Qwen4ExpForCausalLM  # noqa: E402

import ngram_cupy as nc  # noqa: E402
from ngram_cupy.cli.main import main  # noqa: E402
from ngram_cupy.files import safetensors_files  # noqa: E402
from ngram_cupy.runtime.atomic import STALE_SECONDS, TEMP_PREFIX  # noqa: E402
from ngram_cupy.transformers import ngram_config, use_ngram_cupy  # noqa: E402


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
        for weight, name in zip(ple_tables(same), NAMES, strict=True):
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


@pytest.mark.parametrize("to", ["fp8", "nvfp4"])
def test_quantize_command_round_trip(tmp_path, to, capsys):
    """The command's checkpoint, read back by use_ngram_cupy and load_ngram_embedding, holds
    what quantising the model's own rows gives."""
    model = tiny_model(torch.bfloat16)
    model.save_pretrained(tmp_path / "model")
    # A killed run's hidden folder (another host's, a day old): the next run removes it.
    killed = tmp_path / f"{TEMP_PREFIX}0badf00d-1-0badf00d-q"
    (killed / "config.json").parent.mkdir()
    (killed / "config.json").write_text("{}")
    old = time.time() - STALE_SECONDS - 60
    os.utime(killed, (old, old))
    assert main(["quantize", str(tmp_path / "model"), "--to", to, str(tmp_path / "q"),
                 "--quiet"]) == 0
    assert not killed.exists()
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["ple_embedding_dtype"] == ("float8_e4m3fn" if to == "fp8" else "nvfp4")
    from_file, from_model = copy.deepcopy(model), copy.deepcopy(model)
    use_ngram_cupy(from_file, checkpoint=tmp_path / "q", placement="cpu")
    use_ngram_cupy(from_model, weight_dtype=to, placement="cpu")
    ids = prompts()
    with torch.no_grad():
        assert torch.equal(from_file(ids).logits, from_model(ids).logits)
    config = ngram_config(from_file.config.get_text_config())
    embedding = nc.load_ngram_embedding(tmp_path / "q", config, 1, prefix=NAMES[1],
                                        weight_dtype="stored")
    want = from_model.get_submodule(NAMES[1]).table
    assert float(embedding.table.scale) == float(want.scale)
    assert np.array_equal(embedding.table.host_view.view(np.uint8),
                          want.host_view.view(np.uint8))
    other = "model.embed_tokens.weight"
    saved = safetensors_files.Checkpoint.open(tmp_path / "q")
    assert torch.equal(torch.from_numpy(saved.read(other).view(np.int16)).view(torch.bfloat16),
                       model.state_dict()[other])


def test_quantize_command_refusals(tmp_path, capsys, monkeypatch):
    model = tiny_model(torch.bfloat16)
    model.save_pretrained(tmp_path / "model")
    (tmp_path / "exists").mkdir()
    source = str(tmp_path / "model")
    capsys.readouterr()
    for argv, message in (
        ([source, "--to", "fp8", str(tmp_path / "exists")], "exists"),
        ([source, "--to", "mxfp8", str(tmp_path / "out")], "not quantised to mxfp8"),
        ([source, "--to", "mxfp8", str(tmp_path / "out"), "--scheme", "engram"],
         "not an Engram model"),
        ([str(tmp_path), "--to", "fp8", str(tmp_path / "out")], "no config.json"),
    ):
        assert main(["quantize", *argv, "--quiet"]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    plain = Qwen4ExpForCausalLM(tiny_config(ple_layer_ids=[]))
    plain.save_pretrained(tmp_path / "plain")
    capsys.readouterr()
    assert main(["quantize", str(tmp_path / "plain"), "--to", "fp8", str(tmp_path / "out")]) == 2
    assert "no PLE layers" in capsys.readouterr().err

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors_files, "_save", interrupted)
    assert main(["quantize", source, "--to", "fp8", str(tmp_path / "out"), "--quiet"]) == 130
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exists", "model", "plain"]


def test_quantize_command_layers_take_one_value_and_config_json_names_its_folder(tmp_path,
                                                                                capsys):
    """``--layers 1`` before OUTPUT leaves OUTPUT positional; MODEL may be its config.json."""
    tiny_model(torch.bfloat16).save_pretrained(tmp_path / "model")
    config = str(tmp_path / "model" / "config.json")
    assert main(["quantize", config, "--to", "fp8", "--layers", "1", str(tmp_path / "q"),
                 "--quiet"]) == 0
    saved = safetensors_files.Checkpoint.open(tmp_path / "q")
    for layer, dtype in ((0, "BF16"), (1, "F8_E4M3")):
        assert saved.info(f"{NAMES[layer]}.ngram_embedding.shard_0.weight").dtype == dtype
    capsys.readouterr()
    for argv, message in (
        (["--to", "fp8", "--layers", "0", "1", str(tmp_path / "out")], "unrecognized arguments"),
        (["--to", "fp8", "--layers", "0 1", str(tmp_path / "out")], "not a list of layers: '0 1'"),
        (["--layers", "0", "1", "--to", "fp8"], "OUTPUT '1' looks like a layer"),
        (["--to", "fp8", "--layers", "0", "1"], "OUTPUT '1' looks like a layer"),
    ):
        try:
            status = main(["quantize", config, *argv])
        except SystemExit as e:  # argparse's own usage errors
            status = e.code
        err = capsys.readouterr().err
        assert status == 2 and message in err and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "q"]
