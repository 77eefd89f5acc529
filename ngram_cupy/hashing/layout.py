"""Per-layer hash layout: multipliers, per-head prime table sizes and row offsets (docs/ids.md),
and the row ranges a table is cut into (checkpoint shards, ranks).

Everything here is exact host-side integer arithmetic in plain Python ints; the arrays it returns
are what the id kernels consume.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from functools import cache

import numpy as np

from ..runtime.row_split import split_rows  # noqa: F401  (its home before; importers keep it)
from .config import MAX_LAYOUT_PRIMES, NGramConfig

MASK64 = (1 << 64) - 1
SPLITMIX_GAMMA = 0x9E3779B97F4A7C15
SPLITMIX_M1 = 0xBF58476D1CE4E5B9
SPLITMIX_M2 = 0x94D049BB133111EB
LAYER_SEED_STRIDE = 10007

_SMALL_PRIMES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47)
# Witnesses that make Miller-Rabin deterministic for every n < 2**64 (Sinclair's set).
_MR_WITNESSES = (2, 325, 9375, 28178, 450775, 9780504, 1795265022)


def splitmix64(x: int) -> int:
    """One step of the splitmix64 finaliser, all arithmetic modulo 2**64."""
    x = (x + SPLITMIX_GAMMA) & MASK64
    x = ((x ^ (x >> 30)) * SPLITMIX_M1) & MASK64
    x = ((x ^ (x >> 27)) * SPLITMIX_M2) & MASK64
    return x ^ (x >> 31)


def is_prime(n: int) -> bool:
    """Deterministic primality test, exact for every n below 2**64."""
    if n < 2:
        return False
    for p in _SMALL_PRIMES:
        if n % p == 0:
            return n == p
    if n >= 1 << 64:
        raise ValueError(f"is_prime is exact below 2**64 only, got {n}")
    d, s = n - 1, 0
    while d % 2 == 0:
        d //= 2
        s += 1
    for a in _MR_WITNESSES:
        a %= n
        if a == 0:
            continue
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


_prime_runs: dict[int, list[int]] = {}
_prime_lock = threading.Lock()


def primes_after(start: int, count: int) -> list[int]:
    """The first ``count`` primes strictly greater than ``start``, extended and cached per start."""
    with _prime_lock:
        run = _prime_runs.setdefault(start, [])
        candidate = run[-1] + 1 if run else max(start + 1, 2)
        while len(run) < count:
            if is_prime(candidate):
                run.append(candidate)
            candidate += 1
        return run[:count]


def layer_multipliers(config: NGramConfig, layer: int) -> list[int]:
    """Odd per-order hash multipliers, bounded so that ``m * token < 2**63`` for valid tokens."""
    half = max(1, ((1 << 63) - 1) // config.vocab_size // 2)
    base = config.seed + LAYER_SEED_STRIDE * layer
    return [
        2 * (splitmix64(base + SPLITMIX_GAMMA * (i + 1)) % half) + 1
        for i in range(config.ngram_size)
    ]


def _readonly(values: list[int], dtype: type) -> np.ndarray:
    """An immutable 1-D array of exact integers."""
    array = np.array(values, dtype=dtype)
    array.flags.writeable = False
    return array


@dataclass(frozen=True, eq=False)
class LayerLayout:
    """The hash layout of one PLE layer: everything the id kernels and the table need."""

    config: NGramConfig
    layer: int
    multipliers: np.ndarray  # int64 [ngram_size]
    head_sizes: np.ndarray  # int64 [num_heads], primes
    head_offsets: np.ndarray  # int64 [num_heads], first row of each head
    num_rows: int
    padded_rows: int
    # uint64 [num_heads]: floor(2**64 / size), the reciprocal behind the division-free modulo
    head_magics: np.ndarray = field(repr=False)

    @property
    def ngram_size(self) -> int:
        """Longest n-gram hashed (orders 2..ngram_size)."""
        return self.config.ngram_size

    @property
    def heads_per_ngram(self) -> int:
        """Heads (independent hashes) per n-gram order."""
        return self.config.heads_per_ngram

    @property
    def eos_token_id(self) -> int:
        """The token that cuts every history walking back past it."""
        return self.config.eos_token_id

    @property
    def num_heads(self) -> int:
        """Ids per token: ``(ngram_size - 1) * heads_per_ngram``."""
        return self.config.num_heads

    @property
    def head_dim(self) -> int | None:
        """Values per table row, or None when the config has no ``embedding_dim``."""
        return self.config.head_dim

    def table_nbytes(self, itemsize: int) -> int:
        """Bytes of the padded table with ``itemsize``-byte values (needs ``embedding_dim``)."""
        if self.head_dim is None:
            raise ValueError("the config has no embedding_dim, so the table size is unknown")
        return self.padded_rows * self.head_dim * itemsize


def check_layout(layout) -> LayerLayout:
    """Reject anything that is not a ``LayerLayout``."""
    if not isinstance(layout, LayerLayout):
        raise TypeError(
            f"layout must be a LayerLayout (from ngram_cupy.layer_layout), got "
            f"{type(layout).__name__}"
        )
    return layout


@cache
def layer_layout(config: NGramConfig, layer: int) -> LayerLayout:
    """The exact hash layout of dense PLE layer ``layer`` (0-based among the PLE layers), cached."""
    if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
        raise TypeError(f"layer must be an integer, got {type(layer).__name__}")
    layer = int(layer)
    heads = config.num_heads
    if not 0 <= layer < MAX_LAYOUT_PRIMES // heads:
        raise ValueError(
            f"layer must lie in [0, {MAX_LAYOUT_PRIMES // heads}) for {heads} heads per layer "
            f"(every head of layers 0..layer needs a prime: at most MAX_LAYOUT_PRIMES="
            f"{MAX_LAYOUT_PRIMES}), got {layer}"
        )
    primes = primes_after(config.ngram_vocab_size_base - 1, (layer + 1) * heads)
    sizes = primes[layer * heads :]
    offsets = [sum(sizes[:h]) for h in range(heads)]
    num_rows = sum(sizes)
    divisor = config.make_ngram_vocab_size_divisible_by
    padded_rows = -(-num_rows // divisor) * divisor
    return LayerLayout(
        config=config,
        layer=layer,
        multipliers=_readonly(layer_multipliers(config, layer), np.int64),
        head_sizes=_readonly(sizes, np.int64),
        head_offsets=_readonly(offsets, np.int64),
        num_rows=num_rows,
        padded_rows=padded_rows,
        head_magics=_readonly([(1 << 64) // s for s in sizes], np.uint64),
    )
