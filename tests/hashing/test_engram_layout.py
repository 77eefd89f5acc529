"""EngramConfig (fields checked, from_hf) and engram_layout (SPEC 11 multipliers, primes, pad)."""

from __future__ import annotations

import json

import engram_cases
import numpy as np
import pytest

import ngram_cupy as nc
from ngram_cupy.hashing.layout import is_prime
from ngram_cupy.hashing.token_map import TokenMap

GOOD = dict(engram_layer_ids=[2, 14], engram_max_ngram_size=3, engram_n_heads=4,
            engram_head_dim=64, engram_vocab_size=1000, engram_num_embeddings=[9000, 9000],
            engram_compressed_vocab_size=7, engram_pad_token_id=2)


def small_map(size=7, vocab=10):
    ids = np.array([i % size for i in range(vocab)], dtype=np.int32)
    return TokenMap(ids, size, "test")


def test_from_hf_reads_text_config_a_file_and_a_folder(tmp_path):
    config = nc.EngramConfig(**GOOD)
    assert nc.EngramConfig.from_hf({"model_type": "deepseek_v41", "text_config": GOOD}) == config
    (tmp_path / "config.json").write_text(json.dumps({**GOOD, "vocab_size": 129280}))
    assert nc.EngramConfig.from_hf(tmp_path) == config
    assert nc.EngramConfig.from_hf(tmp_path / "config.json") == config
    assert nc.EngramConfig.from_hf(config.to_hf()) == config
    assert config.engram_layer_ids == (2, 14) and config.num_heads == 8


def test_one_row_count_for_every_layer():
    config = nc.EngramConfig(**{**GOOD, "engram_num_embeddings": 9000})
    assert config.engram_num_embeddings == (9000, 9000)


@pytest.mark.parametrize("field, value, match", [
    ("engram_layer_ids", [], "engram_layer_ids must be a non-empty list"),
    ("engram_layer_ids", [3, 3], "must be distinct"),
    ("engram_layer_ids", [-1, 2], r"engram_layer_ids must lie in \[0"),
    ("engram_max_ngram_size", 1, r"engram_max_ngram_size must lie in \[2, 64\]"),
    ("engram_n_heads", 0, "engram_n_heads must lie"),
    ("engram_n_heads", 2.0, "engram_n_heads must be an integer"),
    ("engram_head_dim", 0, "engram_head_dim must lie"),
    ("engram_vocab_size", 1, "engram_vocab_size must lie"),
    ("engram_num_embeddings", [9000], "one row count per layer"),
    ("engram_num_embeddings", [9000, 2**31], "engram_num_embeddings must lie"),
    ("engram_num_embeddings", [9000, 8000], r"engram_num_embeddings\[1\]=8000 is fewer than "
                                            r"the 8\d\d\d rows of layer 14"),
    ("engram_compressed_vocab_size", 0, "engram_compressed_vocab_size must lie"),
    ("engram_pad_token_id", -1, "engram_pad_token_id must lie"),
    ("engram_pad_token_id", True, "engram_pad_token_id must be an integer"),
])
def test_each_field_is_checked(field, value, match):
    with pytest.raises(ValueError, match=match):
        nc.EngramConfig(**{**GOOD, field: value})


def test_from_hf_errors(tmp_path):
    with pytest.raises(ValueError, match="config is missing engram_head_dim"):
        nc.EngramConfig.from_hf({k: v for k, v in GOOD.items() if k != "engram_head_dim"})
    with pytest.raises(FileNotFoundError, match="config file not found"):
        nc.EngramConfig.from_hf(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        nc.EngramConfig.from_hf(tmp_path / "bad.json")
    with pytest.raises(TypeError, match="path_or_dict"):
        nc.EngramConfig.from_hf(3)


def test_layout_follows_spec_11():
    config = nc.EngramConfig(**GOOD)
    layout = nc.engram_layout(config, small_map())
    # One run of consecutive primes above B - 1 = 999, layer by layer, head by head.
    primes = [p for p in range(1000, 1200) if is_prime(p)][:16]
    assert layout.head_sizes.tolist() == [primes[:8], primes[8:]]
    assert layout.head_offsets[1].tolist() == np.cumsum([0, *primes[8:15]]).tolist()
    bound = ((2**63 - 1) // 7) // 2
    for row, layer_id in zip(layout.multipliers, config.engram_layer_ids, strict=True):
        drawn = np.random.default_rng(10007 * layer_id).integers(0, bound, 3, dtype=np.int64)
        assert row.tolist() == (drawn * 2 + 1).tolist()
    assert layout.pad_id == 2 and layout.rows_per_layer == (9000, 9000)
    assert layout.multipliers.shape == (2, 3) and layout.head_sizes.shape == (2, 8)
    assert config.hashed_rows() == layout.head_sizes.sum(axis=1).tolist()
    assert not layout.multipliers.flags.writeable


def test_golden_layout_of_the_synthetic_case():
    layout, case = engram_cases.load_golden("synthetic")
    assert layout.multipliers.tolist() == case["layout"]["multipliers"]
    assert layout.head_sizes.tolist() == case["layout"]["head_sizes"]


def test_layout_errors():
    config = nc.EngramConfig(**GOOD)
    with pytest.raises(ValueError, match=r"compressed vocabulary has 6 ids but the config's "
                                         r"engram_compressed_vocab_size is 7"):
        nc.engram_layout(config, small_map(size=6))
    with pytest.raises(ValueError, match="engram_pad_token_id=2 is not a token"):
        nc.engram_layout(config, small_map(vocab=2, size=7))
    with pytest.raises(TypeError, match="token_map must be a TokenMap"):
        nc.engram_layout(config, np.arange(10))
    with pytest.raises(TypeError, match="config must be an EngramConfig"):
        nc.engram_layout(GOOD, small_map())
