"""Model paths: a missing path is a FileNotFoundError naming it in every loader, and a Hugging Face
Hub id resolves through ``huggingface_hub``'s cache (a local folder in its layout, offline)."""

from __future__ import annotations

import json
import re
import sys

import engram_cases
import numpy as np
import pytest

import ngram_cupy as nc
from ngram_cupy.files.quantize_checkpoint import quantize_checkpoint
from ngram_cupy.files.safetensors_files import Checkpoint
from ngram_cupy.files.text_files import open_json_lines, open_plain_text
from ngram_cupy.files.token_files import open_tokens
from ngram_cupy.text import load_tokenizer

TINY = nc.NGramConfig(vocab_size=50, ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=11,
                      eos_token_id=0, embedding_dim=16, split_ngram_parts=4)
REVISION = "0123456789abcdef0123456789abcdef01234567"


def sgd() -> nc.SGD:
    """An optimizer of a small table, to load a training state into."""
    return nc.SGD(nc.EmbeddingTable(np.zeros((8, 4), np.float32)), lr=0.1)


def engram_layout() -> nc.EngramLayout:
    """A small Engram layout, to load a checkpoint with."""
    return engram_cases.small_layout(np.random.default_rng(0), (2, 1, 1))


LOADERS = {
    "load_ngram_embedding": lambda path: nc.load_ngram_embedding(path, TINY, 0),
    "load_ngram_embedding of files": lambda path: nc.load_ngram_embedding([path], TINY, 0),
    "Checkpoint.open": lambda path: Checkpoint.open(path),
    "NGramConfig.from_hf": nc.NGramConfig.from_hf,
    "EngramConfig.from_hf": nc.EngramConfig.from_hf,
    "load_engram_embedding": lambda path: nc.load_engram_embedding(path, engram_layout()),
    "load_training_state": lambda path: nc.load_training_state(path, sgd()),
    "load_training_state resharded": lambda path: nc.load_training_state([path], sgd()),
    "open_tokens": open_tokens,
    "open_plain_text": lambda path: open_plain_text(str(path), 8),
    "open_json_lines": lambda path: open_json_lines(str(path), 8),
    "quantize_checkpoint": lambda path: quantize_checkpoint(path, "fp8", path.parent / "out"),
    "engram_token_map": nc.engram_token_map,
    "load_tokenizer": lambda path: load_tokenizer(str(path)),
}


@pytest.mark.parametrize("loader", LOADERS.values(), ids=LOADERS.keys())
def test_a_missing_path_is_a_file_not_found_error_naming_it(tmp_path, loader):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        loader(missing)
    assert not (tmp_path / "out").exists()


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty Hub cache under ``tmp_path``, offline: ``HF_HUB_CACHE`` and ``HF_HUB_OFFLINE``."""
    pytest.importorskip("huggingface_hub")
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # a relative "org/name" is not a local folder here
    return cache


def cached_snapshot(cache, repo: str):
    """The snapshot folder of ``repo`` at ``REVISION`` in the cache's layout, ``refs/main``
    naming it."""
    storage = cache / f"models--{repo.replace('/', '--')}"
    (storage / "refs").mkdir(parents=True)
    (storage / "refs" / "main").write_text(REVISION)
    snapshot = storage / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    return snapshot


def test_a_hub_id_loads_from_its_cached_snapshot(hub_cache):
    layout = nc.layer_layout(TINY, 0)
    weight = np.random.default_rng(0).standard_normal(
        (layout.padded_rows, layout.head_dim)).astype(np.float32)
    nc.save_ngram_embedding(cached_snapshot(hub_cache, "org/tiny"), TINY, 0, weight)
    config = nc.NGramConfig.from_hf("org/tiny")
    assert config == TINY
    table = nc.load_ngram_embedding("org/tiny", config, 0).table
    ids = np.arange(layout.padded_rows).reshape(-1, 1)
    np.testing.assert_array_equal(table.lookup(ids, out_dtype=np.float32), weight)


def test_a_local_path_wins_over_a_hub_id(hub_cache):
    (cached_snapshot(hub_cache, "org/tiny") / "config.json").write_text(json.dumps(TINY.to_hf()))
    local = hub_cache.parent / "org" / "tiny"  # "org/tiny" from the working folder
    local.mkdir(parents=True)
    (local / "config.json").write_text(json.dumps({**TINY.to_hf(), "seed": 7}))
    assert nc.NGramConfig.from_hf("org/tiny").seed == 7  # the cached snapshot's is 1234


def test_an_id_neither_local_nor_cached_is_a_file_not_found_error(hub_cache):
    with pytest.raises(FileNotFoundError, match=r"org/absent .*HF_HUB_OFFLINE"):
        nc.load_ngram_embedding("org/absent", TINY, 0)
    with pytest.raises(FileNotFoundError, match="org/absent"):
        nc.NGramConfig.from_hf("org/absent")


def test_without_huggingface_hub_an_id_says_it_is_missing(hub_cache, monkeypatch):
    cached_snapshot(hub_cache, "org/tiny")
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import fails
    with pytest.raises(FileNotFoundError, match=r"org/tiny .*huggingface_hub.*not installed"):
        nc.NGramConfig.from_hf("org/tiny")
