"""Table lookups under torch autograd: the backward either steps a fused row optimizer on the
table (no gradient tensor for the weight) or gives the weight a sparse COO gradient, summed per
row by ``embedding_backward``, for ``torch.optim.SparseAdam`` or ``SGD``.

A prefetch of the next micro-step may gather rows before this step's update lands (the gather
runs beside the backward and the optimizer step): the rows an update may still change when the
prefetch starts (those of the weight's accumulated gradient, not yet stepped) and those of every
gradient after it are remembered, and a lookup that joined a prefetch gathers its tokens
touching them again, so prefetching stays exact in training, gradient accumulation included.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..tables.storage import find_placement
from ..tables.table import EmbeddingTable
from ..training import optimizers
from ..training.backward import embedding_backward
from ..training.table_rows import TRAINABLE, TRAINABLE_NAMES

# Names ``fused_optimizer`` takes -> the row optimizer class in ``training.optimizers``.
OPTIMIZERS = {"sgd": "SGD", "rowwise_adagrad": "RowwiseAdagrad", "adam": "Adam"}


def check_trainable(table: EmbeddingTable, what: str) -> None:
    """A table rows can be trained in: float32 or bfloat16, writable, not a node-wide segment
    (whose rows a module never owns alone)."""
    if table.format not in TRAINABLE:
        raise ValueError(f"{what}: a {table.format.name} table cannot be trained (rows are "
                         f"updated in float32 and stored as {TRAINABLE_NAMES})")
    placement = find_placement(table.placement)
    if not table.storage.writable or placement is not None and not placement.private:
        raise ValueError(f"{what}: placement {table.placement!r} is read-only here; train a "
                         "table in placement 'cpu', 'pinned' or 'gpu'")


class TrainableRows:
    """The trainable state of one layer: its ``weight`` as a ``torch.nn.Parameter`` sharing the
    table's rows, and the fused optimizer that the backward steps (None: sparse gradients)."""

    def __init__(self, weights: torch.nn.Module, what: str):
        check_trainable(weights.table, what)
        self.weights = weights
        self.optimizer = None
        self.prefetched = False  # a prefetch was started since the last lookup
        self._touched: list[torch.Tensor] = []  # ids of the gradients since the last lookup
        weight = weights.weight
        del weights._buffers["weight"]
        weights.weight = torch.nn.Parameter(weight, requires_grad=True)

    @property
    def table(self) -> EmbeddingTable:
        """The table the rows live in."""
        return self.weights.table

    def lookup(self, ids: torch.Tensor, gather: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``gather()`` (the rows of ``ids`` ``[T, H]``, which it may fill) recorded for
        autograd; tokens a prefetch may have read before an update are gathered again."""
        return RowLookup.apply(self.weights.weight, ids, lambda: self._fresh(ids, gather()),
                               self)

    def prefetch_started(self) -> None:
        """A prefetch begins: the rows of the weight's accumulated gradient (micro-steps a
        torch optimizer has not stepped yet) may change before its lookup, as may those of
        every later gradient."""
        self.prefetched = True
        grad = self.weights.weight.grad
        if grad is not None and grad.is_sparse:
            self._touched.append(grad.coalesce().indices()[0])

    def _fresh(self, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` with the tokens that touch rows updated since the prefetch began gathered
        again from the table."""
        touched, self._touched = self._touched, []
        prefetched, self.prefetched = self.prefetched, False
        if not (prefetched and touched):
            return rows
        stale = torch.isin(ids, torch.cat(touched).to(ids.device)).any(dim=1)
        if bool(stale.any()):
            again = torch.empty_like(rows[stale])
            rows[stale] = self.table.lookup(ids[stale].contiguous(), out=again)
        return rows

    def backward(self, ids: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor | None:
        """The weight's gradient for ``grad_out`` ``[T, H * D]``: None after a fused optimizer
        step, else a coalesced sparse COO tensor."""
        grad_out = grad_out.reshape(ids.shape[0], -1).contiguous()
        self._touched.append(ids.reshape(-1))
        if self.optimizer is not None:
            self.optimizer.step_from_output_grad(ids, grad_out)
            return None
        weight = self.weights.weight
        grads = embedding_backward(ids, grad_out, num_rows=self.table.num_rows)
        indices = torch.as_tensor(grads.indices, device=weight.device).reshape(1, -1)
        values = torch.as_tensor(grads.values, device=weight.device).to(weight.dtype)
        return torch.sparse_coo_tensor(indices, values, tuple(weight.shape),
                                       is_coalesced=True, check_invariants=False)


class RowLookup(torch.autograd.Function):
    """A gather whose backward is ``TrainableRows.backward`` (the weight is its input only so
    that autograd reaches it; the rows come from the table)."""

    @staticmethod
    def forward(ctx, weight, ids, gather, rows):
        out = gather()
        ctx.save_for_backward(ids)
        ctx.rows = rows
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (ids,) = ctx.saved_tensors
        return ctx.rows.backward(ids, grad_out), None, None, None


def fused_optimizer(module: torch.nn.Module, name: str, lr: float, **options):
    """Step a row optimizer (``"sgd"``, ``"rowwise_adagrad"`` or ``"adam"``; ``options`` go to
    it) on ``module``'s table inside every backward; returns it (``state_dict``, ...)."""
    rows = getattr(module, "trainable_rows", None)
    if not isinstance(rows, TrainableRows):
        raise ValueError(f"{type(module).__name__} is not trainable: build it with "
                         "trainable=True")
    if name not in OPTIMIZERS:
        raise ValueError(f"name must be one of {', '.join(OPTIMIZERS)}, got {name!r}")
    rows.optimizer = getattr(optimizers, OPTIMIZERS[name])(rows.table, lr=lr, **options)
    return rows.optimizer
