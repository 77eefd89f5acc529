"""Speculative decoding (docs/ids.md's recipe): ids computed for a request's draft tokens, k of
them accepted, the context rolled by exactly the accepted tokens. The accepted tokens' ids and
the context then equal those of a run that only ever saw the accepted tokens, for Qwen4Exp's
n-gram ids and Engram's, through NumPy and the torch module."""

from __future__ import annotations

import engram_cases
import numpy as np
import torch

import ngram_cupy as nc
from ngram_cupy.torch import NGramEmbeddingModule

CONFIG = nc.NGramConfig(50, 3, 2, 31, 0, embedding_dim=8)
LAYOUT = nc.layer_layout(CONFIG, 0)
REQUESTS, STEPS, DRAFT = 3, 4, 4


def accepted_only(drafts, starts, accepted):
    """The accepted tokens of each request packed back to back, their starts, and the mask."""
    kept = np.arange(len(drafts)) < np.repeat(starts[:-1] + accepted, np.diff(starts))
    return drafts[kept], np.concatenate([[0], np.cumsum(accepted)]), kept


def speculative_steps(rng, vocab):
    """Each step's draft tokens (a prefix of each request's true continuation, then wrong
    guesses), starts and accepted counts, and each request's accepted sequence."""
    steps, accepted_tokens = [], [[] for _ in range(REQUESTS)]
    for _ in range(STEPS):
        sizes = rng.integers(0, DRAFT + 1, REQUESTS)
        starts = np.concatenate([[0], np.cumsum(sizes)])
        drafts = rng.integers(0, vocab, starts[-1])
        accepted = rng.integers(0, sizes + 1)
        for r in range(REQUESTS):
            accepted_tokens[r] += drafts[starts[r]:starts[r] + accepted[r]].tolist()
        steps.append((drafts, starts, accepted))
    return steps, [np.array(tokens, np.int64) for tokens in accepted_tokens]


def test_ngram_ids_and_context_after_accepting_drafts():
    steps, sequences = speculative_steps(np.random.default_rng(0), CONFIG.vocab_size)
    module = NGramEmbeddingModule(CONFIG, 0, placement="cpu", weight_dtype=torch.float32)
    module.ngram_embedding.weight.copy_(torch.randn(module.ngram_embedding.weight.shape))
    context = np.zeros((REQUESTS, 2), np.int64)  # EOS: fresh sequences
    kept_ids, kept_rows = [[] for _ in range(REQUESTS)], [[] for _ in range(REQUESTS)]
    for drafts, starts, accepted in steps:
        ids = nc.compute_ngram_ids(LAYOUT, drafts, starts, context)  # verify with these
        rows = module(torch.from_numpy(drafts), torch.from_numpy(starts),
                      torch.from_numpy(context))
        tokens, kept_starts, _ = accepted_only(drafts, starts, accepted)
        context = nc.advance_context(LAYOUT, tokens, kept_starts, context)
        for r in range(REQUESTS):
            kept_ids[r].append(ids[starts[r]:starts[r] + accepted[r]])
            kept_rows[r].append(rows[starts[r]:starts[r] + accepted[r]])
    for r, sequence in enumerate(sequences):
        alone = (torch.from_numpy(sequence), torch.tensor([0, len(sequence)]),
                 torch.zeros((1, 2), dtype=torch.int64))
        assert (np.concatenate(kept_ids[r]) == nc.compute_ngram_ids(
            LAYOUT, *(part.numpy() for part in alone))).all()
        assert torch.equal(torch.cat(kept_rows[r]), module(*alone))
        assert (context[r] == nc.advance_context(LAYOUT, *(part.numpy() for part in alone))).all()


def test_engram_ids_and_lookback_after_accepting_drafts():
    rng = np.random.default_rng(1)
    layout = engram_cases.small_layout(rng, engram_cases.SHAPES[1])
    steps, sequences = speculative_steps(rng, layout.vocab_size)
    lookback = np.full((REQUESTS, layout.ngram_size - 1), -1, np.int64)  # fresh: unknown
    done = np.zeros(REQUESTS, np.int64)  # tokens accepted so far: the next position
    kept_ids = [[] for _ in range(REQUESTS)]
    for drafts, starts, accepted in steps:
        positions = np.concatenate([done[r] + np.arange(starts[r + 1] - starts[r])
                                    for r in range(REQUESTS)]).astype(np.int64)
        ids = nc.compute_engram_ids(layout, drafts, positions, starts, lookback)
        tokens, kept_starts, kept = accepted_only(drafts, starts, accepted)
        lookback = nc.advance_engram_lookback(layout, tokens, kept_starts, lookback)
        for r in range(REQUESTS):
            kept_ids[r].append(ids[starts[r]:starts[r] + accepted[r]])
        done += accepted
    for r, sequence in enumerate(sequences):
        alone = nc.compute_engram_ids(layout, sequence, np.arange(len(sequence)),
                                      [0, len(sequence)], np.full((1, 2), -1))
        assert (np.concatenate(kept_ids[r]) == alone).all()
        rolled = nc.advance_engram_lookback(layout, sequence, [0, len(sequence)],
                                            np.full((1, 2), -1))
        assert (lookback[r] == rolled[0]).all()
