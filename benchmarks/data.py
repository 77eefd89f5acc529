"""Benchmark inputs: the released config, packed token batches, fp8 rows, Zipf-like ids."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np

import ngram_cupy as nc

RELEASED = nc.NGramConfig(
    vocab_size=248320, ngram_size=3, heads_per_ngram=8, ngram_vocab_size_base=20_000_000,
    eos_token_id=248044, embedding_dim=2560, make_ngram_vocab_size_divisible_by=512,
    split_ngram_parts=128,
)
RELEASED_HEADS, RELEASED_HEAD_DIM = 16, 160  # 16 rows of 160 fp8 bytes per token
CORPUS = Path(__file__).resolve().parent.parent / "data" / "python_stdlib.parquet"


def released_batch(num_requests: int, tokens_per_request: int, seed: int = 0):
    """A packed batch of random valid tokens (2% EOS) for the released config."""
    rng = np.random.default_rng(seed)
    num_tokens = num_requests * tokens_per_request
    tokens = rng.integers(0, RELEASED.vocab_size, num_tokens, dtype=np.int64)
    tokens[rng.random(num_tokens) < 0.02] = RELEASED.eos_token_id
    starts = np.arange(0, num_tokens + 1, tokens_per_request, dtype=np.int64)
    context = rng.integers(0, RELEASED.vocab_size, (num_requests, RELEASED.ngram_size - 1))
    return tokens, starts, context


def random_fp8_rows(rng, rows: int) -> np.ndarray:
    """``[rows, 160]`` random float8 e4m3 rows (NaN codes included: they cost the same)."""
    return rng.integers(0, 256, (rows, RELEASED_HEAD_DIM), dtype=np.uint8).view(
        ml_dtypes.float8_e4m3fn)


def rotating(batches: list, fn: Callable) -> Callable[[], object]:
    """``fn`` applied to the next batch on each call: timed calls do not find their rows cached."""
    turn = iter(range(1 << 62))
    return lambda: fn(batches[next(turn) % len(batches)])


def zipf_ids(rng, num_tokens: int, rows: int):
    """Ids of a Zipf-distributed token stream (repeats like text), folded into ``rows``."""
    layout = nc.layer_layout(RELEASED, 0)
    tokens = (rng.zipf(1.2, num_tokens) - 1) % RELEASED.vocab_size
    context = np.full((1, 2), RELEASED.eos_token_id)
    return nc.compute_ngram_ids(layout, tokens, np.array([0, num_tokens]), context) % rows
