"""NGramConfig: validation naming the field, and Hugging Face config.json reading."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ngram_cupy import NGramConfig

VALID = dict(vocab_size=1000, ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=101,
             eos_token_id=2)


@pytest.mark.parametrize(
    "field, value",
    [
        ("vocab_size", 0),
        ("vocab_size", -5),
        ("ngram_size", 1),
        ("heads_per_ngram", 0),
        ("ngram_vocab_size_base", 0),
        ("eos_token_id", 1000),
        ("eos_token_id", -1),
        ("make_ngram_vocab_size_divisible_by", 0),
        ("split_ngram_parts", 0),
        ("embedding_dim", 6),  # 4 heads do not divide 6
        ("embedding_dim", 0),
        ("vocab_size", 10.5),
        ("ngram_size", "3"),
        ("ple_layer_ids", (0, -1)),
        ("ple_layer_ids", 5),
        ("ple_embedding_dtype", 8),
    ],
)
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        NGramConfig(**{**VALID, field: value})


def test_derived_sizes():
    config = NGramConfig(**VALID, embedding_dim=64)
    assert config.num_heads == 4
    assert config.head_dim == 16
    assert NGramConfig(**VALID).head_dim is None


def test_numpy_integers_accepted():
    config = NGramConfig(**{**VALID, "vocab_size": np.int64(1000)})
    assert type(config.vocab_size) is int


HF = {
    "vocab_size": 248320,
    "ngram_size": 3,
    "heads_per_ngram": 8,
    "ngram_vocab_size_base": 20000000,
    "eos_token_id": 248044,
    "make_ngram_vocab_size_divisible_by": 512,
    "split_ngram_parts": 128,
    "ple_embed_dim": 2560,
    "ple_layer_ids": [3, 7],
    "ple_embedding_dtype": "float8_e4m3fn",
}


def test_from_hf_dict_file_and_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(HF))
    for source in (HF, tmp_path / "config.json", tmp_path, str(tmp_path)):
        config = NGramConfig.from_hf(source)
        assert config.embedding_dim == 2560 and config.head_dim == 160
        assert config.ple_layer_ids == (3, 7)
        assert config.ple_embedding_dtype == "float8_e4m3fn"
        assert config.split_ngram_parts == 128 and config.seed == 1234


def test_from_hf_nested_text_config_and_eos_list():
    config = NGramConfig.from_hf({"model_type": "x", "text_config": {**HF, "eos_token_id": [7]}})
    assert config.eos_token_id == 7 and config.vocab_size == 248320


def test_from_hf_errors(tmp_path):
    with pytest.raises(ValueError, match="ngram_size"):
        NGramConfig.from_hf({k: v for k, v in HF.items() if k != "ngram_size"})
    with pytest.raises(ValueError, match="eos_token_id"):
        NGramConfig.from_hf({**HF, "eos_token_id": [1, 2]})
    with pytest.raises(FileNotFoundError, match="missing.json"):
        NGramConfig.from_hf(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="JSON"):
        NGramConfig.from_hf(tmp_path / "bad.json")


# --- documented ranges (issue 9) ----------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value, named",
    [
        ("heads_per_ngram", 1_000_000, "heads_per_ngram"),
        ("ngram_size", 100_000, "ngram_size"),
        ("heads_per_ngram", 600, "(ngram_size - 1) * heads_per_ngram"),  # 2 orders x 600 heads
        ("vocab_size", 2**62, "vocab_size"),  # every multiplier would be 1
        ("vocab_size", 2**32 + 1, "vocab_size"),
        ("ngram_vocab_size_base", 2**62, "ngram_vocab_size_base"),
        ("make_ngram_vocab_size_divisible_by", 2**40, "make_ngram_vocab_size_divisible_by"),
        ("split_ngram_parts", 10**9, "split_ngram_parts"),
        ("embedding_dim", 2**40, "embedding_dim"),
        ("seed", 2**64, "seed"),
        ("ple_layer_ids", (3, 3), "distinct"),
        ("ple_layer_ids", (0, 3), "counted from 1"),
        ("ple_layer_ids", (2**40,), "ple_layer_ids"),
        ("ple_layer_ids", tuple(range(2000)), "ple_layer_ids"),  # 2000 layers x 4 heads
    ],
)
def test_hang_and_silent_wrong_config_out_of_range_names_field_and_value(field, value, named):
    with pytest.raises(ValueError) as error:
        NGramConfig(**{**VALID, field: value})
    assert named in str(error.value)
    if field != "ple_layer_ids":
        assert str(value) in str(error.value)


def test_ranges_edges_are_accepted_and_hash_well():
    import time

    from ngram_cupy import layer_layout

    config = NGramConfig(**{**VALID, "vocab_size": 2**32, "eos_token_id": 0,
                            "ngram_vocab_size_base": 2**48, "heads_per_ngram": 512,
                            "make_ngram_vocab_size_divisible_by": 2**32})
    start = time.perf_counter()
    layout = layer_layout(config, 3)  # 4 layers x 1024 heads: MAX_LAYOUT_PRIMES primes
    elapsed = time.perf_counter() - start
    assert len(set(layout.multipliers.tolist())) == config.ngram_size  # distinct, not all 1
    assert layout.padded_rows < 2**63 and int(layout.head_offsets[-1]) < 2**63
    assert elapsed < 60  # generous: a guard against a hang, not a timing claim


def test_hang_layer_past_the_prime_budget_is_refused():
    from ngram_cupy import layer_layout

    config = NGramConfig(**VALID)
    with pytest.raises(ValueError, match="layer must lie in .* got 1000000"):
        layer_layout(config, 1_000_000)


@pytest.mark.parametrize("value", [None, 3, ["config.json"]])
def test_ugly_from_hf_of_none_names_the_argument(value):
    with pytest.raises(TypeError, match="path_or_dict"):
        NGramConfig.from_hf(value)
