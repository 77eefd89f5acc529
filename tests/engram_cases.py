"""Engram test inputs shared by the CPU and simulator tests: small token maps and layouts, random
packed batches with lookback and dead tokens, and the pinned golden cases."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

import ngram_cupy as nc
from ngram_cupy.hashing.token_map import TokenMap

GOLDEN_DIR = Path(__file__).resolve().parent / "data" / "golden"
# (n, heads per n-gram, layers): bigrams to 4-grams, one to three layers. The kernels unroll all
# three, so each shape is a compile: few shapes (the last is the synthetic golden case's),
# many random batches.
SHAPES = [(2, 1, 1), (3, 2, 3), (4, 2, 2)]


def token_map(rng, vocab: int, distinct: int) -> TokenMap:
    """A random map of ``vocab`` ids onto compressed ids numbered in first-seen order."""
    raw = rng.integers(0, distinct, vocab)
    numbers: dict[int, int] = {}
    ids = np.array([numbers.setdefault(int(x), len(numbers)) for x in raw], dtype=np.int32)
    ids.flags.writeable = False
    return TokenMap(ids, len(numbers), f"random-{vocab}-{distinct}")


def small_layout(rng, shape, vocab: int = 200, base: int = 7) -> nc.EngramLayout:
    """A layout of ``shape`` over a random map, with tiny prime heads (many wraps)."""
    n, k, layers = shape
    tokens = token_map(rng, vocab, max(2, vocab // 3))
    layer_ids = sorted(rng.choice(60, layers, replace=False).tolist())
    config = nc.EngramConfig(layer_ids, n, k, 32, base, [100_000] * layers, tokens.size,
                             int(rng.integers(0, vocab)))
    return nc.engram_layout(config, tokens)


def random_batch(rng, layout, num_tokens: int, num_requests: int, dead_rate: float = 0.15):
    """Tokens, positions (consecutive per request, from random starts, some at 0), request
    starts with empty requests, a lookback with unknown entries, dead masks."""
    vocab, width = layout.vocab_size, layout.ngram_size - 1
    cuts = np.sort(rng.integers(0, num_tokens + 1, num_requests - 1))
    starts = np.concatenate([[0], cuts, [num_tokens]]).astype(np.int64)
    first = rng.integers(0, 6, num_requests) * (rng.random(num_requests) < 0.7)
    positions = np.concatenate([first[r] + np.arange(starts[r + 1] - starts[r])
                                for r in range(num_requests)]).astype(np.int64)
    lookback = rng.integers(0, vocab, (num_requests + 1, width))
    lookback[rng.random(lookback.shape) < 0.25] = -1
    return dict(input_ids=rng.integers(0, vocab, num_tokens), positions=positions,
                query_start_loc=starts, lookback_token_ids=lookback,
                dead_mask=rng.random(num_tokens) < dead_rate,
                lookback_dead_mask=rng.random(lookback.shape) < dead_rate)


def load_golden(name: str):
    """``(layout or None, case dict)`` of ``engram_<name>.json``; the layout needs the case's
    token map (stored, or the caller builds it from the tokenizer)."""
    case = json.loads((GOLDEN_DIR / f"engram_{name}.json").read_text())
    config = nc.EngramConfig(**case["config"])
    if "token_map" not in case:
        return config, case
    ids = np.array(case["token_map"], dtype=np.int32)
    return nc.engram_layout(config, TokenMap(ids, int(ids.max()) + 1, name)), case


def golden_batch(batch: dict) -> tuple[dict, np.ndarray]:
    """A golden batch's arguments as arrays, and its expected ids."""
    kinds = {"input_ids": np.int64, "positions": np.int64, "query_start_loc": np.int64,
             "lookback_token_ids": np.int64, "dead_mask": bool, "lookback_dead_mask": bool}
    args = {name: np.array(batch[name], dtype=kind) for name, kind in kinds.items()
            if name in batch}
    return args, np.array(batch["engram_ids"], dtype=np.int32)
