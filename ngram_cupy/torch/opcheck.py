"""Small valid samples of every registered op (``opcheck_samples``), for
``torch.library.opcheck``: test support, kept beside the ops it exercises."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import torch

from ..hashing.config import NGramConfig
from .autograd import fused_optimizer
from .module import NGramEmbeddingModule


@functools.cache
def _sample_layers() -> tuple:
    """Small live layers for ``opcheck_samples``: two trainable float32 ones (sparse gradients;
    an SGD fused optimizer) and an NVFP4 one (block-scaled ``dequantize``), kept for the
    process."""
    config = NGramConfig(vocab_size=40, ngram_size=3, heads_per_ngram=1, ngram_vocab_size_base=30,
                         eos_token_id=1, embedding_dim=32, seed=5, split_ngram_parts=1)
    trainable = [NGramEmbeddingModule(config, 0, placement="cpu", weight_dtype=torch.float32,
                                      trainable=True) for _ in range(2)]
    for layer in trainable:
        layer.ngram_embedding.weight.data.normal_(generator=torch.Generator().manual_seed(0))
    fused_optimizer(trainable[1], "sgd", lr=0.0)  # opcheck calls it twice: same rows
    packed = NGramEmbeddingModule(config, 0, placement="cpu", weight_dtype="nvfp4")
    return (*trainable, packed)


def opcheck_samples() -> Iterator[tuple[Any, tuple, dict]]:
    """Small valid ``(op, args, kwargs)`` for every registered op, for
    ``torch.library.opcheck(op, args, kwargs)`` (schema, fake, autograd, AOT dispatch)."""
    sparse, fused, packed = _sample_layers()
    ops = torch.ops.ngram_cupy
    tokens = torch.tensor([3, 1, 7, 7, 9, 2], dtype=torch.int64)
    starts = torch.tensor([0, 2, 6], dtype=torch.int64)
    context = torch.tensor([[1, 1], [4, 5]], dtype=torch.int64)
    yield ops.ngram_ids.default, (sparse.handle, tokens, starts, context), {}
    yield ops.ngram_ids.default, (sparse.handle, tokens.reshape(2, 3), None, None), {}
    ids = sparse.compute_ngram_ids(tokens, starts, context)
    width = ids.shape[1] * sparse.layout.head_dim
    for dtype in (torch.float32, torch.bfloat16):
        yield ops.lookup_.default, (sparse.handle, ids, torch.empty((6, width), dtype=dtype)), {}
    yield ops.prefetch_.default, (packed.handle, ids, torch.empty((6, width),
                                                                  dtype=torch.bfloat16)), {}
    weight = sparse.ngram_embedding.weight
    yield ops.trainable_lookup.default, (sparse.handle, weight, ids, torch.float32, False), {}
    yield ops.trainable_lookup.default, (fused.handle,
                                         fused.ngram_embedding.weight, ids, torch.float32,
                                         True), {}
    grad = torch.ones((6, width), dtype=torch.float32)
    yield ops.row_gradient.default, (sparse.handle, ids, grad), {}
    yield ops.optimizer_step_.default, (fused.handle, ids, grad,
                                        fused.ngram_embedding.weight.detach()), {}
    stored = packed.ngram_embedding.weight[:3]
    scales = packed.ngram_embedding.weight_scale[:3].view(torch.uint8)  # opcheck compares
    yield ops.dequantize.default, (packed.handle, stored, scales,
                                   torch.bfloat16), {}
    yield ops.dequantize.default, (sparse.handle, weight.detach()[:4], None, torch.float32), {}

