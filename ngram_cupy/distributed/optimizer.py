"""Row-sharded training across ranks (``torch.distributed``): each rank's row optimizer updates
the rows it owns, from the output gradient of a :class:`ShardedLookup`.

Tensor parallel (every rank the same batch and output gradient): each rank keeps the terms of
its own rows. Data parallel (each rank its own batch): every term is sent to its row's owner
with all-to-alls of uneven splits (``all_to_all_single``, which Gloo has in torch 2.13 where its
list form needs equal sizes: counts first, then ids, then gradient rows), and
the owner sums what it receives in rank order, so each row's sum has exactly the terms, in the
order, of one process stepping on the batches concatenated in rank order: the same bits.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..hashing.layout import split_rows
from ..tables.row_ids import check_row_ids
from .lookup import ShardedLookup

__all__ = ["ShardedOptimizer"]

GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _ranks(group) -> list[int]:
    """The global ranks of ``group`` (None: the world group)."""
    return dist.get_process_group_ranks(dist.group.WORLD if group is None else group)


class ShardedOptimizer:
    """Steps ``optimizer`` (``SGD``, ``RowwiseAdagrad`` or ``Adam`` over this rank's shard, the
    table of ``lookup``) with the output gradient of ``lookup``'s rows.

    Data parallel needs ``lookup.dp_group`` to be its table group (every rank owns a shard and
    has a batch). Every rank of the group calls :meth:`step_from_output_grad` once per step,
    in the same order (a collective in data parallel).
    """

    def __init__(self, lookup: ShardedLookup, optimizer):
        if not isinstance(lookup, ShardedLookup):
            raise TypeError(f"lookup must be a ShardedLookup, got {type(lookup).__name__}")
        if getattr(optimizer, "table", None) is not lookup.table:
            raise ValueError("optimizer must be a row optimizer of lookup.table (the shard the "
                             "lookup reads), got one of another table: the steps would miss "
                             "the rows the lookup serves")
        self.lookup, self.optimizer = lookup, optimizer  # the lookup checked the group
        self.data_parallel = lookup.dp_group is not None
        if self.data_parallel and _ranks(lookup.dp_group) != _ranks(lookup.group):
            raise ValueError("data-parallel training needs dp_group to be the table group "
                             "(every rank owns a shard and has its own batch)")

    @property
    def table(self):
        """This rank's shard."""
        return self.lookup.table

    def step_from_output_grad(self, ids, grad_out) -> None:
        """One step from ``grad_out`` ``[T, H * D]`` (float32, bfloat16 or float16) of this
        rank's lookup of ``ids`` ``[T, H]`` (NumPy or torch; CUDA tensors with NCCL); no ids is a
        step that changes no row. A step refused on one rank (bad ids or ``grad_out``, NaN or
        infinite gradients, a row's terms summing past float32, a closed optimizer) is refused
        on every rank before any row changes: the refusing rank raises its own error, the others
        a ValueError naming it, and no rank is left waiting in a collective."""
        device = ids.device if isinstance(ids, torch.Tensor) else torch.device("cpu")
        refusal = update = None
        try:
            self.optimizer.check_open()
            ids, grad_out = self._checked(ids, grad_out)
        except Exception as error:  # any error: no rank is left waiting
            refusal = error  # raised once every rank knows
        if self.data_parallel:
            ids, grad_out = self._route(ids, grad_out, device, refusal)
        elif refusal is None:
            start = self.table.row_start
            mine = (ids >= start) & (ids < start + self.table.num_rows)
            ids, grad_out = ids[mine], grad_out[mine].contiguous()
        if refusal is None:  # the owner's checks of its rows' terms
            try:
                update = self.optimizer.checked_step(ids, grad_out)
            except Exception as error:  # any error: no rank is left waiting
                refusal = error
        self._agree(refusal, device)
        update()

    def _agree(self, refusal: Exception | None, device) -> None:
        """Raise ``refusal`` here, and a ValueError naming the refusing ranks on the others,
        when any rank of the group refused (one all-reduce of a flag per rank)."""
        group = self.lookup.group
        flags = torch.zeros(dist.get_world_size(group), dtype=torch.int64, device=device)
        flags[dist.get_rank(group)] = int(refusal is not None)
        dist.all_reduce(flags, group=group)
        if refusal is not None:
            raise refusal
        refused = torch.nonzero(flags).flatten().tolist()
        if refused:
            raise ValueError(f"rank(s) {refused} of the group refused this step: it is refused "
                             "on every rank and no row changed")

    def _checked(self, ids, grad_out) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids [N] int64, grad_out [N, head_dim] float32)``, checked (float32 holds every
        accepted gradient dtype exactly, so every rank sends the same dtype)."""
        ids, grad_out = torch.as_tensor(ids), torch.as_tensor(grad_out)
        if ids.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"ids must be int32 or int64, got {ids.dtype}")
        if grad_out.dtype not in GRAD_DTYPES:
            raise TypeError(f"grad_out must be float32, bfloat16 or float16, got "
                            f"{grad_out.dtype}")
        head_dim, total = self.table.head_dim, self.table.total_rows
        shapes = {(*ids.shape, head_dim)}  # [N, D] or [T, H, D], and [T, H * D]
        if ids.ndim:
            shapes.add((ids.shape[0], math.prod(ids.shape[1:]) * head_dim))
        if tuple(grad_out.shape) not in shapes:
            raise ValueError(f"grad_out must hold {ids.numel()} rows of head_dim={head_dim} "
                             f"(one per id, shaped {' or '.join(map(str, sorted(shapes)))} for ids "
                             f"of shape {tuple(ids.shape)}), got shape {tuple(grad_out.shape)}")
        start = self.table.row_start  # the lookup's IndexError: the first bad id, its position
        check_row_ids(ids, total, held=(start, start + self.table.num_rows))
        ids = ids.reshape(-1).to(torch.int64)
        grad_out = grad_out.reshape(ids.numel(), head_dim).to(torch.float32)
        if not bool(torch.isfinite(grad_out).all()):
            raise ValueError("grad_out holds NaN or infinite values: the step is refused on "
                             "every rank and no row changed")
        return ids, grad_out

    def _route(self, ids, grad_out, device, refusal: Exception | None = None):
        """Every term sent to its row's owner; the terms received, in source rank order. The
        counts travel with each rank's refusal flag: a refusal anywhere raises everywhere."""
        group = self.lookup.group
        size = dist.get_world_size(group)
        if refusal is None:
            starts = [split_rows(self.table.total_rows, size, rank)[0]
                      for rank in range(1, size)]
            owner = torch.bucketize(ids, torch.tensor(starts, dtype=torch.int64,
                                                     device=device), right=True)
            order = torch.argsort(owner, stable=True)
            sent = torch.bincount(owner, minlength=size)
        else:
            sent = torch.zeros(size, dtype=torch.int64, device=device)
        header = torch.stack((sent, torch.full_like(sent, int(refusal is not None))), dim=1)
        got = torch.empty_like(header)
        dist.all_to_all_single(got, header, group=group)
        if refusal is not None:
            raise refusal
        refused = [rank for rank, flag in enumerate(got[:, 1].tolist()) if flag]
        if refused:
            raise ValueError(f"rank(s) {refused} of the group refused this step: it is refused "
                             "on every rank and no row changed")
        sent, got = sent.tolist(), got[:, 0].tolist()
        ids_in = torch.empty(sum(got), dtype=torch.int64, device=device)
        dist.all_to_all_single(ids_in, ids[order], got, sent, group=group)
        grads_in = grad_out.new_empty((sum(got), grad_out.shape[1]))
        dist.all_to_all_single(grads_in, grad_out[order].contiguous(), got, sent, group=group)
        return ids_in, grads_in
