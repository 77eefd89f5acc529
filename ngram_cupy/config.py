"""Model-level n-gram embedding configuration, validated once at construction."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import numpy as np


def _require_int(name: str, value: Any) -> int:
    """Return ``value`` as an int, or raise naming the field when it is not an integer."""
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return value


@dataclass(frozen=True)
class NGramConfig:
    """Hash and table parameters shared by every PLE layer of one model."""

    vocab_size: int
    ngram_size: int
    heads_per_ngram: int
    ngram_vocab_size_base: int
    eos_token_id: int
    embedding_dim: int | None = None
    seed: int = 1234
    make_ngram_vocab_size_divisible_by: int = 1
    split_ngram_parts: int = 512
    ple_layer_ids: tuple[int, ...] | None = None
    ple_embedding_dtype: str | None = None

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "ngram_size",
            "heads_per_ngram",
            "ngram_vocab_size_base",
            "eos_token_id",
            "seed",
            "make_ngram_vocab_size_divisible_by",
            "split_ngram_parts",
        ):
            object.__setattr__(self, name, _require_int(name, getattr(self, name)))
        if self.embedding_dim is not None:
            object.__setattr__(
                self, "embedding_dim", _require_int("embedding_dim", self.embedding_dim)
            )
        if self.ple_layer_ids is not None:
            if not isinstance(self.ple_layer_ids, (list, tuple, np.ndarray)):
                raise ValueError(f"ple_layer_ids must be a list of integers, got "
                                 f"{self.ple_layer_ids!r}")
            ids = tuple(_require_int("ple_layer_ids", i) for i in self.ple_layer_ids)
            object.__setattr__(self, "ple_layer_ids", ids)
        if self.ple_embedding_dtype is not None and not isinstance(self.ple_embedding_dtype, str):
            raise ValueError(f"ple_embedding_dtype must be a dtype name, got "
                             f"{self.ple_embedding_dtype!r}")
        self._check()

    def _check(self) -> None:
        """Reject values for which the hash layout is undefined."""
        if self.vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {self.vocab_size}")
        if self.ngram_size < 2:
            raise ValueError(f"ngram_size must be >= 2, got {self.ngram_size}")
        if self.heads_per_ngram <= 0:
            raise ValueError(f"heads_per_ngram must be > 0, got {self.heads_per_ngram}")
        if self.ngram_vocab_size_base <= 0:
            raise ValueError(
                f"ngram_vocab_size_base must be positive, got {self.ngram_vocab_size_base}"
            )
        if not 0 <= self.eos_token_id < self.vocab_size:
            raise ValueError(
                f"eos_token_id must lie in [0, vocab_size={self.vocab_size}), "
                f"got {self.eos_token_id}"
            )
        if self.make_ngram_vocab_size_divisible_by <= 0:
            raise ValueError(
                "make_ngram_vocab_size_divisible_by must be positive, "
                f"got {self.make_ngram_vocab_size_divisible_by}"
            )
        if self.split_ngram_parts <= 0:
            raise ValueError(f"split_ngram_parts must be positive, got {self.split_ngram_parts}")
        if self.embedding_dim is not None:
            if self.embedding_dim <= 0:
                raise ValueError(f"embedding_dim must be positive, got {self.embedding_dim}")
            if self.embedding_dim % self.num_heads:
                raise ValueError(
                    f"embedding_dim={self.embedding_dim} must be divisible by the number of "
                    f"n-gram heads (ngram_size - 1) * heads_per_ngram = {self.num_heads}"
                )
        if self.ple_layer_ids is not None and any(i < 0 for i in self.ple_layer_ids):
            raise ValueError(f"ple_layer_ids must be non-negative, got {self.ple_layer_ids}")

    @property
    def num_heads(self) -> int:
        """Total hash heads per layer: ``heads_per_ngram`` for each order 2..ngram_size."""
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def head_dim(self) -> int | None:
        """Values per table row, or None when ``embedding_dim`` is not set."""
        if self.embedding_dim is None:
            return None
        return self.embedding_dim // self.num_heads

    @classmethod
    def from_hf(cls, path_or_dict: str | os.PathLike | dict) -> NGramConfig:
        """Read a Hugging Face style ``config.json`` (a file, a model folder, or a dict)."""
        if isinstance(path_or_dict, dict):
            raw = path_or_dict
        else:
            path = os.fspath(path_or_dict)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            try:
                with open(path, encoding="utf-8") as f:
                    raw = json.load(f)
            except FileNotFoundError:
                raise ValueError(f"config file not found: {path}") from None
            except json.JSONDecodeError as e:
                raise ValueError(f"config file {path} is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError("config must be a JSON object")
        if isinstance(raw.get("text_config"), dict):
            raw = {**raw, **raw["text_config"]}
        required = ("vocab_size", "ngram_size", "heads_per_ngram", "ngram_vocab_size_base",
                    "eos_token_id")
        missing = [key for key in required if key not in raw]
        if missing:
            raise ValueError(f"config is missing {', '.join(missing)}")
        eos = raw["eos_token_id"]
        if isinstance(eos, list):
            if len(eos) != 1:
                raise ValueError(f"eos_token_id must be a single token id, got {eos}")
            eos = eos[0]
        return cls(
            vocab_size=raw["vocab_size"],
            ngram_size=raw["ngram_size"],
            heads_per_ngram=raw["heads_per_ngram"],
            ngram_vocab_size_base=raw["ngram_vocab_size_base"],
            eos_token_id=eos,
            embedding_dim=raw.get("ple_embed_dim"),
            seed=raw.get("seed", 1234),
            make_ngram_vocab_size_divisible_by=raw.get("make_ngram_vocab_size_divisible_by", 1),
            split_ngram_parts=raw.get("split_ngram_parts", 512),
            ple_layer_ids=raw.get("ple_layer_ids"),
            ple_embedding_dtype=raw.get("ple_embedding_dtype"),
        )
