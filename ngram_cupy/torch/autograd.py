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

import torch

from ..tables.table import EmbeddingTable
from ..training.backward import embedding_backward
from ..training.optimizers import OPTIMIZERS
from ..training.table_rows import check_trainable


def trainable_weight(table: EmbeddingTable, weight: torch.Tensor) -> torch.Tensor:
    """The rows as a parameter trains them: host rows through the storage's writable rows (a
    shared segment's mapping, which every process updates: Hogwild), device rows as they are."""
    if table.host_view is None:
        return weight
    return torch.from_numpy(table.storage.cold.training_rows()).view(weight.dtype)


class TrainableRows:
    """The trainable state of one layer: its ``weight`` as a ``torch.nn.Parameter`` sharing the
    table's rows, and the fused optimizer that the backward steps (None: sparse gradients)."""

    def __init__(self, weights: torch.nn.Module, what: str):
        check_trainable(weights.table, what)
        self.weights = weights
        self.optimizer = None
        self.optimizer_arguments: tuple | None = None  # (class, lr, options) of ``optimizer``
        self.prefetched = False  # a prefetch was started since the last lookup
        self._touched: list[torch.Tensor] = []  # ids of the gradients since the last lookup
        weight = trainable_weight(weights.table, weights.weight)
        del weights._buffers["weight"]
        weights.weight = torch.nn.Parameter(weight, requires_grad=True)

    @property
    def table(self) -> EmbeddingTable:
        """The table the rows live in."""
        return self.weights.table

    def moved_to(self, table: EmbeddingTable) -> None:
        """The rows now live in ``table`` (a shared layer's segment, once every shard is
        loaded): the parameter keeps its identity over the table's writable rows, and a fused
        optimizer starts afresh on them."""
        check_trainable(table, "trainable=True")
        self.weights.weight.data = trainable_weight(table, self.weights.weight.detach())
        if self.optimizer_arguments is not None:
            kind, lr, options = self.optimizer_arguments
            self.optimizer = kind(table, lr=lr, **options)

    def prefetch_started(self) -> None:
        """A prefetch begins: the rows of the weight's accumulated gradient (micro-steps a
        torch optimizer has not stepped yet) may change before its lookup, as may those of
        every later gradient."""
        self.prefetched = True
        grad = self.weights.weight.grad
        if grad is not None and grad.is_sparse:
            self._touched.append(grad.coalesce().indices()[0])

    def fresh(self, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` with the tokens that touch rows updated since the prefetch began gathered
        again from the table: every token is gathered again and the stale ones taken, so that
        nothing waits on the host to count them (a GPU prefetch stays asynchronous)."""
        touched, self._touched = self._touched, []
        prefetched, self.prefetched = self.prefetched, False
        if not (prefetched and touched):
            return rows
        stale = torch.isin(ids, torch.cat(touched).to(ids.device)).any(dim=1, keepdim=True)
        again = self.table.lookup(ids.contiguous(), out=torch.empty_like(rows))
        return torch.where(stale, again, rows, out=rows)

    def backward(self, ids: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor | None:
        """The weight's gradient for ``grad_out`` ``[T, H * D]``: None after a fused optimizer
        step, else a coalesced sparse COO tensor."""
        grad_out = grad_out.reshape(ids.shape[0], ids.shape[1] * self.table.head_dim)
        grad_out = grad_out.contiguous()  # (an empty batch has no -1 to infer)
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


def fused_optimizer(module: torch.nn.Module, name: str, lr: float, **options):
    """Step a row optimizer (``"sgd"``, ``"rowwise_adagrad"`` or ``"adam"``; ``options`` go to
    it) on ``module``'s table inside every backward; returns it (``state_dict``, ...)."""
    rows = getattr(module, "trainable_rows", None)
    if not isinstance(rows, TrainableRows):
        raise ValueError(f"{type(module).__name__} is not trainable: build it with "
                         "trainable=True")
    if name not in OPTIMIZERS:
        raise ValueError(f"name must be one of {', '.join(OPTIMIZERS)}, got {name!r}")
    rows.optimizer = OPTIMIZERS[name](rows.table, lr=lr, **options)
    rows.optimizer_arguments = (OPTIMIZERS[name], lr, options)
    return rows.optimizer
