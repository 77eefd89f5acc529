"""Model-level n-gram embedding configuration, validated once at construction.

Every field has a range derived from the arithmetic it feeds (checked up front, a ``ValueError``
naming the field and the value outside it):

- ``vocab_size`` in ``[1, 2**32]``: multipliers are odd values below ``2**63 / vocab_size``, so
  at least ``2**30`` of them to draw from keeps the ``ngram_size`` multipliers distinct and mixing
  (a vocabulary near ``2**62`` would make every multiplier 1).
- ``ngram_size`` in ``[2, 64]``, ``heads_per_ngram`` in ``[1, 1024]`` and
  ``num_heads = (ngram_size - 1) * heads_per_ngram <= 1024``: the id kernels are compiled with
  these loops unrolled, and every head of every PLE layer needs its own prime.
- ``ngram_vocab_size_base`` in ``[1, 2**48]`` and ``make_ngram_vocab_size_divisible_by`` in
  ``[1, 2**32]``: a layer then has fewer than ``2**59`` rows, so every id fits int64 and the
  division-free modulo of every prime head size stays exact.
- ``len(ple_layer_ids) * num_heads <= MAX_LAYOUT_PRIMES`` (and the same for the ``layer`` asked
  of ``layer_layout``): the head sizes are that many consecutive primes, found by a
  deterministic Miller-Rabin test, so any layout is computed in about a second.
- ``eos_token_id`` in ``[0, vocab_size)``; ``seed`` an int64 or uint64 value;
  ``split_ngram_parts`` in ``[1, 2**16]``; ``embedding_dim`` in ``[1, 2**24]`` and a multiple of
  ``num_heads``; ``ple_layer_ids`` distinct, in ``[1, 2**31)``: decoder layer numbers counted
  from 1, as transformers and vLLM write them (PLE layer ``k`` runs in the decoder module
  ``model.layers.{ple_layer_ids[k] - 1}``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..runtime.model_paths import local_path

MAX_VOCAB_SIZE = 1 << 32
MAX_NGRAM_SIZE = 64
MAX_HEADS = 1024
MAX_NGRAM_VOCAB_SIZE_BASE = 1 << 48
MAX_DIVISIBLE_BY = 1 << 32
MAX_SPLIT_PARTS = 1 << 16
MAX_EMBEDDING_DIM = 1 << 24
MAX_LAYER_ID = (1 << 31) - 1
# Primes a layout may need (all heads of all layers up to the one asked for): about a second.
MAX_LAYOUT_PRIMES = 4096


def _require_range(name: str, value: int, low: int, high: int, why: str = "") -> None:
    """``low <= value <= high``, or a ValueError naming the field, the value and the range."""
    if not low <= value <= high:
        raise ValueError(f"{name} must lie in [{low}, {high}]{why}, got {value}")


def _require_int(name: str, value: Any) -> int:
    """Return ``value`` as an int, or raise naming the field when it is not an integer."""
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return value


@dataclass(frozen=True)
class NGramConfig:
    """Hash and table parameters shared by every PLE layer of one model (ranges: module doc).

    Args:
        vocab_size: the tokenizer's vocabulary, ``[1, 2**32]``.
        ngram_size: the longest n-gram, ``[2, 64]``; orders 2..ngram_size are hashed.
        heads_per_ngram: hash heads per order, ``[1, 1024]``; ``num_heads = (ngram_size - 1) *
            heads_per_ngram <= 1024``.
        ngram_vocab_size_base: the base table size a head's prime size is searched above,
            ``[1, 2**48]``.
        eos_token_id: the token that cuts the n-gram history, ``[0, vocab_size)``.
        embedding_dim: ``num_heads * head_dim`` (config key ``ple_embed_dim``), a multiple of
            ``num_heads`` in ``[1, 2**24]``; default None: unknown (ids only, no tables).
        seed: the hash multipliers' seed, an int64 or uint64 value; default 1234.
        make_ngram_vocab_size_divisible_by: rows are padded to a multiple of it, ``[1, 2**32]``;
            default 1.
        split_ngram_parts: checkpoint shards per table, ``[1, 2**16]``; default 512.
        ple_layer_ids: the decoder layers that have a PLE layer, counted from 1 as transformers
            and vLLM write them (PLE layer ``k`` is module ``model.layers.{ids[k] - 1}``),
            distinct, in ``[1, 2**31)``; default None: unknown (checkpoint prefixes are then
            taken in decoder order).
        ple_embedding_dtype: the tables' storage type by name (``"float8_e4m3fn"``,
            ``"bfloat16"``, ``"nvfp4"``, ...); default None: not stated.

    Raises:
        ValueError naming the field and the value when one is outside its range.
    """

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
        """Reject values outside the ranges the layout arithmetic is defined for (module doc)."""
        _require_range("vocab_size", self.vocab_size, 1, MAX_VOCAB_SIZE,
                       " (larger vocabularies leave the hash multipliers too few values)")
        _require_range("ngram_size", self.ngram_size, 2, MAX_NGRAM_SIZE)
        _require_range("heads_per_ngram", self.heads_per_ngram, 1, MAX_HEADS)
        _require_range("(ngram_size - 1) * heads_per_ngram", self.num_heads, 1, MAX_HEADS,
                       f" (ngram_size={self.ngram_size}, heads_per_ngram={self.heads_per_ngram})")
        _require_range("ngram_vocab_size_base", self.ngram_vocab_size_base, 1,
                       MAX_NGRAM_VOCAB_SIZE_BASE, " (ids must fit int64)")
        if not 0 <= self.eos_token_id < self.vocab_size:
            raise ValueError(
                f"eos_token_id must lie in [0, vocab_size={self.vocab_size}), "
                f"got {self.eos_token_id}"
            )
        _require_range("seed", self.seed, -(1 << 63), (1 << 64) - 1)
        _require_range("make_ngram_vocab_size_divisible_by",
                       self.make_ngram_vocab_size_divisible_by, 1, MAX_DIVISIBLE_BY)
        _require_range("split_ngram_parts", self.split_ngram_parts, 1, MAX_SPLIT_PARTS)
        if self.embedding_dim is not None:
            _require_range("embedding_dim", self.embedding_dim, 1, MAX_EMBEDDING_DIM)
            if self.embedding_dim % self.num_heads:
                raise ValueError(
                    f"embedding_dim={self.embedding_dim} must be divisible by the number of "
                    f"n-gram heads (ngram_size - 1) * heads_per_ngram = {self.num_heads}"
                )
        if self.ple_layer_ids is not None:
            for layer_id in self.ple_layer_ids:
                _require_range("ple_layer_ids", layer_id, 1, MAX_LAYER_ID,
                               " (decoder layers counted from 1)")
            if len(set(self.ple_layer_ids)) != len(self.ple_layer_ids):
                raise ValueError(f"ple_layer_ids must be distinct, got {self.ple_layer_ids}")
            if len(self.ple_layer_ids) * self.num_heads > MAX_LAYOUT_PRIMES:
                raise ValueError(
                    f"ple_layer_ids holds {len(self.ple_layer_ids)} layers of {self.num_heads} "
                    f"heads: more than MAX_LAYOUT_PRIMES={MAX_LAYOUT_PRIMES} head sizes to find"
                )

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

    def to_hf(self) -> dict[str, Any]:
        """The Hugging Face ``config.json`` keys that ``from_hf`` reads (unset ones left out)."""
        raw = {"vocab_size": self.vocab_size, "ngram_size": self.ngram_size,
               "heads_per_ngram": self.heads_per_ngram,
               "ngram_vocab_size_base": self.ngram_vocab_size_base,
               "eos_token_id": self.eos_token_id, "ple_embed_dim": self.embedding_dim,
               "seed": self.seed,
               "make_ngram_vocab_size_divisible_by": self.make_ngram_vocab_size_divisible_by,
               "split_ngram_parts": self.split_ngram_parts,
               "ple_layer_ids": None if self.ple_layer_ids is None else list(self.ple_layer_ids),
               "ple_embedding_dtype": self.ple_embedding_dtype}
        return {key: value for key, value in raw.items() if value is not None}

    @classmethod
    def from_hf(cls, path_or_dict: str | os.PathLike | dict) -> NGramConfig:
        """Read a Hugging Face style ``config.json``: the keys of the constructor's arguments
        (``ple_embed_dim`` for ``embedding_dim``; a one-element ``eos_token_id`` list gives its
        id; ``text_config`` fields are merged in), unknown keys ignored.

        Args:
            path_or_dict: a ``config.json`` file, a model folder holding one, a Hugging Face Hub
                id (``"org/model"``, when no such local path exists), or a dict.

        Returns:
            The :class:`NGramConfig`; ``ple_layer_ids`` kept as written (counted from 1).
        """
        raw = read_hf_config(path_or_dict)
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


def read_hf_config(path_or_dict: str | os.PathLike | dict) -> dict:
    """A Hugging Face ``config.json`` as one dict (a file, a model folder, a Hub id resolved by
    ``local_path``, or a dict), its ``text_config`` fields merged in; a FileNotFoundError naming
    a missing file, a ValueError for bad JSON."""
    if isinstance(path_or_dict, dict):
        raw = path_or_dict
    elif not isinstance(path_or_dict, (str, os.PathLike)):
        raise TypeError(f"path_or_dict must be a path or a dict, got "
                        f"{type(path_or_dict).__name__}")
    else:
        path = local_path(path_or_dict, "config file", ("config.json",))
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        try:
            with open(path, "rb") as f:
                raw = json.loads(f.read().decode("utf-8"))
        except FileNotFoundError:
            raise FileNotFoundError(f"config file not found: {path}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"config file {path} is not valid JSON: {e}") from None
        except UnicodeDecodeError as e:
            raise ValueError(f"config file {path} is not UTF-8 text: byte {e.start} "
                             f"({e.object[e.start:e.start + 1]!r}) {e.reason}") from None
        except IsADirectoryError:
            raise ValueError(f"config file {path} is a folder, not a file") from None
        if not isinstance(raw, dict):
            raise ValueError(f"config file {path} must hold a JSON object, got "
                             f"{type(raw).__name__}")
    if not isinstance(raw, dict):
        raise ValueError("config must be a JSON object")
    if isinstance(raw.get("text_config"), dict):
        raw = {**raw, **raw["text_config"]}
    return raw
