"""The Engram hash layout of all layers at once (docs/engram.md): multipliers, prime head sizes
and offsets per layer, the pad id, and the token map the kernels read.

Host-side exact integers, like ``layout.py`` for Qwen4Exp (whose prime search it reuses).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache

import numpy as np

from .engram_config import EngramConfig
from .token_map import TokenMap

LAYER_SEED_STRIDE = 10007


def engram_multipliers(layer_ids: tuple[int, ...], ngram_size: int,
                       compressed_vocab_size: int) -> np.ndarray:
    """``int64 [L, n]`` odd multipliers: ``2 * integers(0, bound) + 1`` from NumPy's
    ``default_rng(10007 * layer_id)``, with ``bound`` keeping ``m * token < 2**63``."""
    bound = max(1, ((1 << 63) - 1) // compressed_vocab_size // 2)
    rows = [np.random.default_rng(LAYER_SEED_STRIDE * layer_id).integers(
        0, bound, size=ngram_size, dtype=np.int64) * 2 + 1 for layer_id in layer_ids]
    return np.array(rows, dtype=np.int64).reshape(len(layer_ids), ngram_size)


def _readonly(array: np.ndarray) -> np.ndarray:
    """``array`` made immutable."""
    array.flags.writeable = False
    return array


@dataclass(frozen=True, eq=False)
class EngramLayout:
    """Everything the Engram id kernels and tables need, for all ``L`` layers."""

    config: EngramConfig
    token_map: np.ndarray  # int32 [vocab]: compressed id of every tokenizer id
    pad_id: int  # the compressed id of engram_pad_token_id
    multipliers: np.ndarray  # int64 [L, n]
    head_sizes: np.ndarray  # int64 [L, H], primes
    head_offsets: np.ndarray  # int64 [L, H], first row of each head in its layer's table
    # uint64 [L, H]: floor(2**64 / size), the reciprocal behind the division-free modulo
    head_magics: np.ndarray = field(repr=False)

    @property
    def ngram_size(self) -> int:
        """Longest n-gram hashed (orders 2..n)."""
        return self.config.engram_max_ngram_size

    @property
    def heads_per_ngram(self) -> int:
        """Heads per n-gram order (``engram_n_heads``)."""
        return self.config.engram_n_heads

    @property
    def num_heads(self) -> int:
        """Ids per token and layer (H)."""
        return self.config.num_heads

    @property
    def num_layers(self) -> int:
        """Engram layers (L)."""
        return self.config.num_layers

    @property
    def layer_ids(self) -> tuple[int, ...]:
        """The decoder layers that hold an Engram."""
        return self.config.engram_layer_ids

    @property
    def vocab_size(self) -> int:
        """Token ids the map covers (the tokenizer's, added tokens included)."""
        return int(self.token_map.shape[0])

    @property
    def rows_per_layer(self) -> tuple[int, ...]:
        """Rows of each layer's table (``engram_num_embeddings``)."""
        return self.config.engram_num_embeddings

    @property
    def head_dim(self) -> int:
        """Values per table row."""
        return self.config.engram_head_dim


def check_engram_layout(layout) -> EngramLayout:
    """Reject anything that is not an ``EngramLayout``."""
    if not isinstance(layout, EngramLayout):
        raise TypeError(f"layout must be an EngramLayout (from ngram_cupy.engram_layout), got "
                        f"{type(layout).__name__}")
    return layout


def engram_layout(config: EngramConfig, token_map: TokenMap) -> EngramLayout:
    """The exact layout of every Engram layer of ``config`` over ``token_map``'s compressed ids
    (cached); the map's CV must be the config's."""
    if not isinstance(config, EngramConfig):
        raise TypeError(f"config must be an EngramConfig, got {type(config).__name__}")
    if not isinstance(token_map, TokenMap):
        raise TypeError(f"token_map must be a TokenMap (from ngram_cupy.engram_token_map), got "
                        f"{type(token_map).__name__}")
    return _engram_layout(config, token_map)


@cache
def _engram_layout(config: EngramConfig, token_map: TokenMap) -> EngramLayout:
    """``engram_layout`` of checked arguments, once per pair."""
    if token_map.size != config.engram_compressed_vocab_size:
        raise ValueError(
            f"the tokenizer's compressed vocabulary has {token_map.size} ids but the config's "
            f"engram_compressed_vocab_size is {config.engram_compressed_vocab_size}: every hash "
            f"multiplier derives from it, so this tokenizer does not fit this model")
    if config.engram_pad_token_id >= token_map.vocab_size:
        raise ValueError(f"engram_pad_token_id={config.engram_pad_token_id} is not a token of the "
                         f"tokenizer ({token_map.vocab_size} ids)")
    sizes = np.array(config.head_sizes(), dtype=np.int64).reshape(config.num_layers, -1)
    offsets = np.cumsum(sizes, axis=1) - sizes
    magics = np.array([[(1 << 64) // int(s) for s in row] for row in sizes],
                      dtype=np.uint64).reshape(sizes.shape)
    return EngramLayout(
        config=config,
        token_map=token_map.ids,
        pad_id=int(token_map.ids[config.engram_pad_token_id]),
        multipliers=_readonly(engram_multipliers(
            config.engram_layer_ids, config.engram_max_ngram_size,
            config.engram_compressed_vocab_size)),
        head_sizes=_readonly(sizes),
        head_offsets=_readonly(offsets),
        head_magics=_readonly(magics),
    )
