"""Layer layouts: exact against the golden files, primes, multipliers and the released sizes."""

from __future__ import annotations

import numpy as np
import pytest

from ngram_cupy import NGramConfig, layer_layout
from ngram_cupy.hashing.layout import is_prime, primes_after, splitmix64


def test_golden_layouts(golden):
    layout, expected, _ = golden
    assert layout.multipliers.tolist() == expected["multipliers"]
    assert layout.head_sizes.tolist() == expected["head_sizes"]
    assert layout.head_offsets.tolist() == expected["head_offsets"]
    assert layout.num_rows == expected["num_rows"]
    assert layout.padded_rows == expected["padded_rows"]


def test_is_prime_against_sieve():
    limit = 20000
    sieve = np.ones(limit, dtype=bool)
    sieve[:2] = False
    for p in range(2, int(limit**0.5) + 1):
        if sieve[p]:
            sieve[p * p :: p] = False
    assert [n for n in range(limit) if is_prime(n)] == np.flatnonzero(sieve).tolist()


@pytest.mark.parametrize(
    "n, prime",
    [
        (2**61 - 1, True),  # Mersenne prime
        (2**64 - 59, True),  # largest 64-bit prime
        (3215031751, False),  # strong pseudoprime to bases 2, 3, 5, 7
        (3825123056546413051, False),  # strong pseudoprime to bases 2..23
        (318665857834031151167461, None),  # beyond 64 bits: refused
    ],
)
def test_is_prime_hard_cases(n, prime):
    if prime is None:
        with pytest.raises(ValueError):
            is_prime(n)
    else:
        assert is_prime(n) is prime


def test_primes_after_is_strict_and_consecutive():
    assert primes_after(6, 3) == [7, 11, 13]
    assert primes_after(7, 2) == [11, 13]
    assert primes_after(0, 3) == [2, 3, 5]
    assert primes_after(-5, 1) == [2]


def test_splitmix64_known_value():
    # splitmix64 seeded with 0 returns 0xE220A8397B1DCDAF as its first output.
    assert splitmix64(0) == 0xE220A8397B1DCDAF


def test_multipliers_are_odd_and_bounded(released_config):
    for layer in (0, 1, 17):
        m = layer_layout(released_config, layer).multipliers
        assert np.all(m % 2 == 1)
        assert all(int(x) * (released_config.vocab_size - 1) < 2**63 for x in m)


def test_released_layers_continue_the_prime_sequence(released_config):
    previous = layer_layout(released_config, 62)
    last = layer_layout(released_config, 63)
    assert last.head_sizes[0] == primes_after(int(previous.head_sizes[-1]), 1)[0]
    assert np.all(np.diff(last.head_sizes) > 0)
    assert all(is_prime(int(s)) for s in last.head_sizes)
    assert last.head_offsets[-1] + last.head_sizes[-1] == last.num_rows
    assert last.padded_rows % 512 == 0 and 0 <= last.padded_rows - last.num_rows < 512
    assert last.head_dim == 160 and last.table_nbytes(1) == last.padded_rows * 160


def test_layout_is_cached_and_immutable(released_config):
    layout = layer_layout(released_config, 0)
    assert layer_layout(released_config, 0) is layout
    with pytest.raises(ValueError):
        layout.multipliers[0] = 1
    with pytest.raises(AttributeError):
        layout.num_rows = 1
    assert np.all(layout.head_magics == (2**64 // layout.head_sizes.astype(object)))


def test_bad_layer_and_oversized_layout():
    config = NGramConfig(vocab_size=10, ngram_size=2, heads_per_ngram=1,
                         ngram_vocab_size_base=7, eos_token_id=0)
    with pytest.raises(ValueError, match="layer"):
        layer_layout(config, -1)
    with pytest.raises(TypeError, match="layer"):
        layer_layout(config, 1.0)
    with pytest.raises(ValueError, match="ngram_vocab_size_base"):  # ids would overflow int64
        NGramConfig(vocab_size=10, ngram_size=3, heads_per_ngram=2,
                    ngram_vocab_size_base=2**62, eos_token_id=0)
    with pytest.raises(ValueError, match="embedding_dim"):
        layer_layout(config, 0).table_nbytes(1)
