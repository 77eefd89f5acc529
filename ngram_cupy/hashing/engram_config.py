"""DeepSeek V4.1 Engram configuration (docs/engram.md), validated once at construction.

The fields keep the Hugging Face ``text_config`` names. Ranges follow from the arithmetic:
ids are int32, so every layer's table has fewer than ``2**31`` rows; the multipliers draw from
``2**63 / engram_compressed_vocab_size`` values; the head sizes are ``L * H`` consecutive primes
(at most ``MAX_LAYOUT_PRIMES``, as for Qwen4Exp), and each layer's table must hold all of them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from .config import (
    MAX_HEADS,
    MAX_LAYER_ID,
    MAX_LAYOUT_PRIMES,
    MAX_NGRAM_SIZE,
    MAX_VOCAB_SIZE,
    read_hf_config,
)
from .layout import primes_after

# Ids are int32: a layer's rows (and so every prime head size) stay below 2**31.
MAX_ENGRAM_ROWS = (1 << 31) - 1
MAX_ENGRAM_HEAD_DIM = 1 << 24

FIELDS = ("engram_layer_ids", "engram_max_ngram_size", "engram_n_heads", "engram_head_dim",
          "engram_vocab_size", "engram_num_embeddings", "engram_compressed_vocab_size",
          "engram_pad_token_id")


def _integer(name: str, value: Any, low: int, high: int) -> int:
    """``value`` as an int in ``[low, high]``, or a ValueError naming the field."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name} must lie in [{low}, {high}], got {value}")
    return int(value)


def _integers(name: str, values: Any, low: int, high: int) -> tuple[int, ...]:
    """A non-empty list of integers in ``[low, high]`` as a tuple, or a ValueError."""
    if not isinstance(values, (list, tuple, np.ndarray)) or len(values) == 0:
        raise ValueError(f"{name} must be a non-empty list of integers, got {values!r}")
    return tuple(_integer(name, value, low, high) for value in values)


@dataclass(frozen=True)
class EngramConfig:
    """Hash and table parameters of a model's Engram layers (all layers share them)."""

    engram_layer_ids: tuple[int, ...]
    engram_max_ngram_size: int
    engram_n_heads: int
    engram_head_dim: int
    engram_vocab_size: int
    engram_num_embeddings: tuple[int, ...]
    engram_compressed_vocab_size: int
    engram_pad_token_id: int

    def __post_init__(self) -> None:
        layer_ids = _integers("engram_layer_ids", self.engram_layer_ids, 0, MAX_LAYER_ID)
        if len(set(layer_ids)) != len(layer_ids):
            raise ValueError(f"engram_layer_ids must be distinct, got {list(layer_ids)}")
        set_field = object.__setattr__
        set_field(self, "engram_layer_ids", layer_ids)
        set_field(self, "engram_max_ngram_size",
                  _integer("engram_max_ngram_size", self.engram_max_ngram_size, 2,
                           MAX_NGRAM_SIZE))
        set_field(self, "engram_n_heads",
                  _integer("engram_n_heads", self.engram_n_heads, 1, MAX_HEADS))
        if self.num_heads * self.num_layers > MAX_LAYOUT_PRIMES:
            raise ValueError(
                f"{self.num_layers} Engram layers of (engram_max_ngram_size - 1) * "
                f"engram_n_heads = {self.num_heads} heads need more than MAX_LAYOUT_PRIMES="
                f"{MAX_LAYOUT_PRIMES} head sizes")
        set_field(self, "engram_head_dim",
                  _integer("engram_head_dim", self.engram_head_dim, 1, MAX_ENGRAM_HEAD_DIM))
        set_field(self, "engram_vocab_size",
                  _integer("engram_vocab_size", self.engram_vocab_size, 2, MAX_ENGRAM_ROWS))
        rows = self.engram_num_embeddings
        if isinstance(rows, (int, np.integer)) and not isinstance(rows, bool):
            rows = (rows,) * self.num_layers
        rows = _integers("engram_num_embeddings", rows, 1, MAX_ENGRAM_ROWS)
        if len(rows) != self.num_layers:
            raise ValueError(f"engram_num_embeddings must hold one row count per layer of "
                             f"engram_layer_ids ({self.num_layers}), got {len(rows)}")
        set_field(self, "engram_num_embeddings", rows)
        set_field(self, "engram_compressed_vocab_size",
                  _integer("engram_compressed_vocab_size", self.engram_compressed_vocab_size, 1,
                           MAX_VOCAB_SIZE))
        set_field(self, "engram_pad_token_id",
                  _integer("engram_pad_token_id", self.engram_pad_token_id, 0, MAX_VOCAB_SIZE))
        for index, (needed, held) in enumerate(zip(self.hashed_rows(), rows, strict=True)):
            if held < needed:
                raise ValueError(
                    f"engram_num_embeddings[{index}]={held} is fewer than the {needed} rows of "
                    f"layer {layer_ids[index]}'s head sizes (their sum)")

    @property
    def num_layers(self) -> int:
        """Engram layers (L)."""
        return len(self.engram_layer_ids)

    @property
    def num_heads(self) -> int:
        """Ids per token and layer: ``H = (engram_max_ngram_size - 1) * engram_n_heads``."""
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads

    def head_sizes(self) -> list[list[int]]:
        """``[L][H]`` prime bucket sizes: one run of consecutive primes above
        ``engram_vocab_size - 1``, layer by layer, head by head."""
        heads = self.num_heads
        primes = primes_after(self.engram_vocab_size - 1, self.num_layers * heads)
        return [primes[layer * heads : (layer + 1) * heads] for layer in range(self.num_layers)]

    def hashed_rows(self) -> list[int]:
        """Rows each layer's heads address: the sum of its head sizes."""
        return [sum(sizes) for sizes in self.head_sizes()]

    def to_hf(self) -> dict[str, Any]:
        """The ``text_config`` keys that ``from_hf`` reads."""
        raw = {name: getattr(self, name) for name in FIELDS}
        raw["engram_layer_ids"] = list(self.engram_layer_ids)
        raw["engram_num_embeddings"] = list(self.engram_num_embeddings)
        return raw

    @classmethod
    def from_hf(cls, path_or_dict: str | os.PathLike | dict) -> EngramConfig:
        """Read a Hugging Face ``config.json`` (a file, a model folder, or a dict), its
        ``text_config`` included."""
        raw = read_hf_config(path_or_dict)
        missing = [name for name in FIELDS if name not in raw]
        if missing:
            raise ValueError(f"config is missing {', '.join(missing)} (not an Engram model?)")
        return cls(**{name: raw[name] for name in FIELDS})
