"""Row-sharded lookups across ranks (docs/torch.md), communicating through ``torch.distributed``
(Gloo on CPUs, NCCL on GPUs).

Each rank of a table group loads only its slice of the rows (``load_ngram_embedding(...,
rank=r, world_size=n)``); its lookup writes zeros for rows it does not own, and a sum over the
group gives the full lookup exactly, since every row has one owner. Data-parallel ranks that
share one table group first gather each other's ids (each padded to the largest count), all look
up the same gathered batch, sum, and keep their own slice.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..embedding import NGramEmbedding
from ..hashing.layout import split_rows
from ..runtime.backends import DEVICE, bind, cuda_stream, device_index, where
from ..runtime.checks import check_index_array
from ..runtime.install_hint import install_hint
from ..tables.table import EmbeddingTable


def _dist():
    """``torch.distributed``, initialised, or a clear error."""
    try:
        import torch.distributed as dist
    except ImportError:
        raise ImportError("sharded lookups need torch: " + install_hint("torch")) from None
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call init_process_group first")
    return dist


def _as_bytes(array):
    """A torch uint8 tensor over a C-contiguous NumPy or CuPy array's bytes (no copy)."""
    import torch

    return torch.from_dlpack(array.view("u1"))


class ShardedLookup:
    """Lookups in a table whose rows are split across the ranks of ``group``.

    ``source`` is an ``NGramEmbedding`` (or its table) loaded with this rank's slice of the rows:
    ``load_ngram_embedding(..., rank=group rank, world_size=group size)``.

    - ``dp_group=None`` (tensor parallel): every rank of ``group`` passes the same ids; one
      all-reduce over ``group``.
    - ``dp_group`` given (data parallel): each rank of ``dp_group`` passes its own ids (any
      count, zero included); they are gathered over ``dp_group`` padded to the largest count,
      looked up, summed over ``group`` and each rank keeps its own tokens. With DP ranks that
      share one table, ``dp_group = group``.

    Every rank of ``group`` must call each method the same number of times, in the same order
    (these are collectives). ``group=None`` is the default (world) group.
    """

    def __init__(self, source, group=None, dp_group=None):
        self.embedding = source if isinstance(source, NGramEmbedding) else None
        self.table = source.table if self.embedding is not None else source
        if not isinstance(self.table, EmbeddingTable):
            raise TypeError(f"source must be an NGramEmbedding or an EmbeddingTable, got "
                            f"{type(source).__name__}")
        dist = _dist()
        self.group, self.dp_group = group, dp_group
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        owned = (self.table.row_start, self.table.row_start + self.table.num_rows)
        expected = split_rows(self.table.total_rows, size, rank)
        if owned != expected:
            raise ValueError(
                f"rank {rank} of a group of {size} must own rows {expected} of "
                f"{self.table.total_rows}, but the table owns {owned}: load it with "
                f"rank={rank}, world_size={size}"
            )

    def lookup(self, ids, num_tokens_across_dp: Sequence[int] | None = None, out_dtype=None):
        """Rows for this rank's ids ``[T, H]`` (NumPy or CUDA), summed over the group.

        ``num_tokens_across_dp``: every ``dp_group`` rank's token count, when the caller knows
        them (saves one small all-gather); ignored without ``dp_group``. ``out_dtype`` as in
        ``EmbeddingTable.lookup``.
        """
        dist = _dist()
        call = bind(_torch_stream_of(ids), ids=ids)
        ids = call["ids"]
        check_index_array("ids", ids, 2)  # before the collectives: float ids are no row ids
        with call.on():
            local_tokens, offset = ids.shape[0], 0
            if self.dp_group is not None:
                ids, offset = self._gather_ids(dist, ids, num_tokens_across_dp)
            out = self.table.lookup(ids, out_dtype=out_dtype, stream=call.stream)
            if out.size:  # a byte-wise sum: each byte has one non-zero term at most, so it is
                # an exact copy of the owner's bits (a float sum would turn -0.0 into 0.0)
                dist.all_reduce(_as_bytes(out), group=self.group)
        out_format, _ = self.table.destination(call.side, (0, 0), None, out_dtype)
        return call.result(out[offset : offset + local_tokens], out_format)

    def forward(self, input_ids, query_start_loc, ngram_context, **kwargs):
        """N-gram ids of this rank's batch, then :meth:`lookup` (``kwargs`` go to it)."""
        if self.embedding is None:
            raise TypeError("forward needs an NGramEmbedding; this ShardedLookup has a table")
        ids = self.embedding.compute_ids(input_ids, query_start_loc, ngram_context)
        return self.lookup(ids, **kwargs)

    __call__ = forward

    def _gather_ids(self, dist, ids, counts: Sequence[int] | None):
        """Every dp rank's ids, padded with row 0 to the largest count (padding rows are looked
        up and dropped: -1 would be refused, ``row_ids``), concatenated; and where this rank's
        tokens start in them."""
        import torch

        local = torch.from_dlpack(ids.astype(np.int64, copy=False))
        dp_size, dp_rank = dist.get_world_size(self.dp_group), dist.get_rank(self.dp_group)
        if counts is None:
            mine = torch.tensor([ids.shape[0]], dtype=torch.int64, device=local.device)
            gathered = [torch.empty_like(mine) for _ in range(dp_size)]
            dist.all_gather(gathered, mine, group=self.dp_group)
            counts = [int(c) for c in gathered]
        if len(counts) != dp_size or counts[dp_rank] != ids.shape[0]:
            raise ValueError(
                f"num_tokens_across_dp must list {dp_size} counts with {ids.shape[0]} at "
                f"position {dp_rank}, got {list(counts)}"
            )
        slot = max(counts)
        padded = torch.zeros((slot, ids.shape[1]), dtype=torch.int64, device=local.device)
        padded[: ids.shape[0]] = local
        if slot:
            parts = [torch.empty_like(padded) for _ in range(dp_size)]
            dist.all_gather(parts, padded, group=self.dp_group)
            padded = torch.cat(parts)
        gathered_ids = padded.numpy() if padded.device.type == "cpu" else _cupy_view(padded)
        return gathered_ids, dp_rank * slot


def _cupy_view(tensor):
    """A CuPy view of a CUDA torch tensor."""
    return DEVICE.asarray(tensor)


def _torch_stream_of(ids):
    """Torch's current stream for GPU ids (CuPy work then runs where the collectives run),
    None for host ids."""
    if where(ids) is not DEVICE:
        return None
    import torch

    device = device_index(ids)  # the ids' GPU, not the current one
    return cuda_stream(torch.cuda.current_stream(device), device)
