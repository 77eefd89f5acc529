"""``CachedNGramEmbedding``: one PLE layer in transformers' call shape, the n-gram context kept
in the model's cache; ``use_ngram_cupy`` (transformers.py) puts it in place of transformers'
own layer. It runs the step both torch layers share (``layer.py``)."""

from __future__ import annotations

import torch

from ..embedding import NGramEmbedding
from ..hashing.layout import LayerLayout
from ..runtime.backends import DEVICE
from ..tables.table import EmbeddingTable
from ..training.table_rows import check_trainable
from .layer import LayerStep, SteppedLayer

# The cache's conv state that holds each PLE layer's last n-1 tokens (transformers' layout).
CONTEXT_STATE = 2


def one_cache(cache, past_key_values):
    """The cache under either of its names (``cache`` from transformers 5.25 on,
    ``past_key_values`` before); both at once is ambiguous."""
    if cache is not None and past_key_values is not None and cache is not past_key_values:
        raise TypeError("pass the cache once, as cache= or past_key_values=, not both")
    return past_key_values if cache is None else cache


class CachedNGramEmbedding(SteppedLayer, torch.nn.Module):
    """One PLE layer's n-gram embedding for transformers: ids of ``[B, S]`` rows (every row one
    sequence, left padding hashed as it is) after the context the cache holds, then the rows of
    ``embedding.table`` in the model dtype (``out_like``'s, which follows ``model.to(dtype)``).

    ``state_dict`` keys are transformers' (the table's storage dtype, plus ``weight_scale`` for
    float8); the table itself never moves with ``.to()``. ``prefetch``: gather during the
    preceding decoder layer (None: only for CUDA inputs and a table outside GPU memory).
    ``trainable``: ``ngram_embedding.weight`` is a parameter over the rows that a backward
    reaches (``TrainableRows``).
    """

    def __init__(self, embedding: NGramEmbedding, layer_idx: int, dtype: torch.dtype,
                 prefetch: bool | None = None, trainable: bool = False):
        super().__init__()
        layout, table = embedding.layout, embedding.table
        self.step = LayerStep(embedding)  # what the registered ops reach by ``handle``
        self.layer_idx = layer_idx
        self.context_len = layout.ngram_size - 1
        self.prefetch = prefetch
        self._host_ids = not table.storage.reads(DEVICE)  # CUDA batches go to the CPU
        self.register_buffer("layer_multipliers", torch.tensor(layout.multipliers))
        self.register_buffer("ngram_heads_vocab_sizes", torch.tensor(layout.head_sizes))
        self.register_buffer("ngram_heads_offsets", torch.tensor(layout.head_offsets))
        self.register_buffer("out_like", torch.empty(0, dtype=dtype), persistent=False)
        if trainable:  # the core's rule: a shared segment trains too (Hogwild)
            check_trainable(table, "trainable=True")
        if table.storage.writable or trainable:  # a read-only table is no module's weight
            scale = table.scale  # TableWeights starts a scaled table at scale 1
            self.ngram_embedding = self.step.hold(table, trainable)
            if table.format.scaled:  # float8's scale, NVFP4's global one
                self.ngram_embedding.set_scale(torch.tensor(float(scale)))

    @property
    def layout(self) -> LayerLayout:
        """The layer's hash layout."""
        return self.embedding.layout

    @property
    def table(self) -> EmbeddingTable:
        """The table the rows live in."""
        return self.embedding.table

    def _context(self, cache) -> torch.Tensor | None:
        """The n-1 tokens before this batch, per row, from the cache; None for fresh rows."""
        if cache is None:
            return None
        cached = cache.get_conv_state(self.layer_idx, state_idx=CONTEXT_STATE)
        return None if cached is None else cached[:, -self.context_len:]

    def _ids(self, input_ids: torch.Tensor, context: torch.Tensor | None) -> torch.Tensor:
        """``[B * S, H]`` ids, on the GPU when the table is readable there, else on the CPU."""
        if input_ids.is_cuda and self._host_ids:
            input_ids = input_ids.cpu()
            context = None if context is None else context.cpu()
        return self.step.ids(input_ids, None, context)

    def start_prefetch(self, input_ids: torch.Tensor, cache=None) -> None:
        """Start gathering this batch's rows (side CUDA stream, or a CPU worker) so that the
        next ``forward`` finds them; a stale prefetch costs time, never correctness."""
        ids = self._ids(input_ids.long(), self._context(cache))
        self.step.start_prefetch(ids, self.out_like.dtype)

    def forward(self, input_ids: torch.Tensor, cache=None, *, past_key_values=None,
                **kwargs) -> torch.Tensor:
        """``[B, S, H * head_dim]`` embeddings; rolls the cache's context on by this batch.

        The cache comes as transformers passes it (second argument, ``cache=`` from 5.25,
        ``past_key_values=`` before); the model's other keyword arguments
        (``output_router_logits``, attention settings, ...) are accepted and unused, as
        transformers' own layer does."""
        cache = one_cache(cache, past_key_values)  # past_key_values: releases before 5.25
        input_ids = input_ids.long()
        batch, length = input_ids.shape
        context = self._context(cache)
        ids = self._ids(input_ids, context)
        if cache is not None:  # a fresh prompt shorter than n-1: stored after EOS
            new = input_ids
            if context is None and length < self.context_len:
                new = torch.nn.functional.pad(new, (self.context_len - length, 0),
                                              value=self.layout.eos_token_id)
            cache.update_conv_state(new, self.layer_idx, state_idx=CONTEXT_STATE,
                                    conv_kernel_size=self.context_len)
        trainable = self.trainable_rows is not None and torch.is_grad_enabled()
        rows = self.step.lookup(ids, self.out_like.dtype, trainable=trainable)
        return rows.to(input_ids.device).view(batch, length, -1)

    def extra_repr(self) -> str:
        return (f"layer_idx={self.layer_idx}, heads={self.layout.num_heads}, "
                f"head_dim={self.table.head_dim}, weight_dtype={self.table.format.name}, "
                f"placement={self.table.placement!r}")
