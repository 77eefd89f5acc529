"""Optimizers that update an ``EmbeddingTable``'s rows in place, their state beside the rows.

Each step takes sparse row gradients (``step``) or the lookup's output gradient
(``step_from_output_grad``: the backward fused into the update, no ``[U, D]`` gradient made).
Every check runs before any row changes: a refused step leaves rows and state as they were.
"""

from __future__ import annotations

import math

import numpy as np

from ..runtime.backends import HOST, bind
from . import backward_numba, gpu_steps, updates_numba
from .inputs import check_finite, check_ids_inside, flat_inputs
from .sparse_rows import SparseRows
from .table_rows import copy_into, host_copy, refresh_hot, state_array, writable_rows


def finite_number(name: str, value, low: float = 0.0, high: float = math.inf,
                  closed_high: bool = False) -> float:
    """``value`` as a float in ``[low, high)`` (``]`` when ``closed_high``); errors name it."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    value = float(value)
    inside = low <= value <= high if closed_high else low <= value < high
    if not math.isfinite(value) or not inside:
        raise ValueError(f"{name} must be finite and in [{low}, {high}{']' if closed_high else ')'}"
                         f", got {value}")
    return value


WEIGHT_DECAY_MODES = ("l2", "decoupled")


def hyper_array(lr: float, eps: float = 0.0, decay: float = 0.0,
                adam: tuple[float, float, float] = (0.0, 0.0, 0.0), max_norm: float | None = None,
                decoupled: bool = False) -> np.ndarray:
    """The float32 hyper-parameters ``update_rows`` reads, in its slot order."""
    hyper = np.zeros(updates_numba.HYPER_SIZE, np.float32)
    hyper[[updates_numba.LR, updates_numba.EPS, updates_numba.DECAY]] = lr, eps, decay
    hyper[[updates_numba.ONE_MINUS_BETA1, updates_numba.ONE_MINUS_BETA2,
           updates_numba.STEP_SIZE]] = adam
    hyper[updates_numba.MAX_NORM] = 0.0 if max_norm is None else max_norm
    hyper[updates_numba.DECOUPLED] = float(decoupled)
    return hyper


class DecayRules:
    """FBGEMM's row-wise rules: weight decay added to the gradient (``"l2"``) or applied to the
    row beside the update (``"decoupled"``), and rows scaled down to ``max_norm`` after it."""

    def set_rules(self, weight_decay, weight_decay_mode: str, max_norm) -> None:
        """Check and keep the three settings (errors name the argument)."""
        self.weight_decay = finite_number("weight_decay", weight_decay)
        if weight_decay_mode not in WEIGHT_DECAY_MODES:
            raise ValueError(f"weight_decay_mode must be one of {WEIGHT_DECAY_MODES}, got "
                             f"{weight_decay_mode!r}")
        self.weight_decay_mode = weight_decay_mode
        self.max_norm = None if max_norm is None else finite_number("max_norm", max_norm)
        if self.max_norm is not None and not np.float32(self.max_norm) > 0:
            raise ValueError(f"max_norm must be positive (None: no clamp), got {max_norm}")

    def rules_hyper(self, eps: float = 0.0) -> np.ndarray:
        """``hyper_array`` with the learning rate, ``eps`` and the three rules."""
        return hyper_array(self.lr, eps, self.weight_decay, max_norm=self.max_norm,
                           decoupled=self.weight_decay_mode == "decoupled")

    def rules_settings(self) -> dict:
        """The rules as a state dict records them."""
        return {"weight_decay": self.weight_decay, "weight_decay_mode": self.weight_decay_mode,
                "max_norm": self.max_norm}


class RowOptimizer:
    """The common part: the table's writable rows, named float32 state arrays, a step count."""

    kind = -1
    name = ""
    state_widths: tuple[tuple[str, bool], ...] = ()  # (name, one value per row)

    def __init__(self, table, lr: float, *, stochastic_rounding: bool = False, seed: int = 0):
        self.table = table
        self.lr = finite_number("lr", lr)
        self.rows = writable_rows(table)
        self.on_gpu = table.storage.cold.device_resident  # rows and state in GPU memory
        self.code = table.format.code  # the row format the kernel loads and stores
        self.stochastic_rounding = bool(stochastic_rounding)
        self.seed = int(seed) & ((1 << 64) - 1)
        self.steps = 0
        self.state: dict[str, np.ndarray] = {}
        self.segments = []  # shared state segments, attached while the optimizer lives
        for key, rowwise in self.state_widths:
            array, segment = state_array(table, f"{self.name}.{key}",
                                         1 if rowwise else table.head_dim)
            self.state[key] = array
            if segment is not None:
                self.segments.append(segment)

    @property
    def state_bytes_per_row(self) -> int:
        """Bytes of optimizer state per table row."""
        return sum(4 * (1 if rowwise else self.table.head_dim)
                   for _, rowwise in self.state_widths)

    def hyper(self, step: int) -> np.ndarray:
        """The float32 hyper-parameters of step ``step`` (see ``updates_numba``)."""
        return hyper_array(self.lr)

    # ---- steps ----

    def step(self, grads: SparseRows) -> None:
        """Update the rows of ``grads`` (global, sorted unique ``indices``, float32 ``values``
        ``[U, head_dim]``)."""
        if self.on_gpu:
            gpu_steps.step(self, grads)
            return
        grads = gpu_steps.host_sparse_rows(grads)  # GPU gradients of a host table: copied over
        call = bind(indices=grads.indices, values=grads.values)
        indices, values = call["indices"], call["values"]
        if indices.ndim != 1 or indices.dtype.kind not in "iu":
            raise TypeError(f"grads.indices must be a 1-D integer array, got {indices.dtype} "
                            f"{tuple(indices.shape)}")
        if values.dtype != np.float32 or values.shape != (indices.shape[0], self.table.head_dim):
            raise ValueError(f"grads.values must be float32 [{indices.shape[0]}, "
                             f"{self.table.head_dim}], got {values.dtype} {tuple(values.shape)}")
        if indices.size > 1 and not bool((np.diff(indices) > 0).all()):
            raise ValueError("grads.indices must be sorted and unique (embedding_backward's)")
        start = self.table.row_start
        check_ids_inside(indices, start, start + self.table.num_rows, "grads.indices")
        check_finite(values)
        local = indices.astype(np.int64) - start
        count = np.arange(local.shape[0] + 1, dtype=np.int64)
        self.apply(local, count[:-1], count, np.ascontiguousarray(values))

    def step_from_output_grad(self, ids, grad_out) -> None:
        """Backward and update in one pass: ``ids`` ``[N]`` / ``[T, H]`` (global rows) and the
        lookup's output gradient ``grad_out`` (as ``embedding_backward`` takes them)."""
        if self.on_gpu:
            gpu_steps.step_from_output_grad(self, ids, grad_out)
            return
        call = bind(ids=ids, grad_out=grad_out)
        if call.side is not HOST:  # summed on the GPU, the distinct rows applied here
            self.step(gpu_steps.host_rows_of_device_grad(self, call))
            return
        flat, grad = flat_inputs(call["ids"], call["grad_out"], call.formats.get("grad_out"))
        if grad.shape[1] != self.table.head_dim:
            raise ValueError(f"grad_out has {grad.shape[1]} values per head, the table "
                             f"{self.table.head_dim}")
        start, rows = self.table.row_start, self.table.num_rows
        check_ids_inside(call["ids"], start, start + rows)
        check_finite(grad)
        order, unique, starts = backward_numba.sorted_order(flat.astype(np.int64, copy=False),
                                                            start, rows)
        self.apply(unique - start, order, starts, np.ascontiguousarray(grad))

    def apply(self, local, order, starts, grad) -> None:
        """Run the update kernel on checked inputs, then refresh hot copies."""
        step = self.steps + 1
        empty = np.zeros((0, 1), np.float32)
        first = self.state.get(self.state_widths[0][0], empty) if self.state_widths else empty
        second = self.state.get(self.state_widths[1][0], empty) if len(self.state_widths) > 1 \
            else empty
        updates_numba.update_rows(self.kind, self.rows, self.code, local, order, starts, grad,
                                  first, second, self.hyper(step), self.stochastic_rounding,
                                  np.uint64(self.seed), np.uint64(step))
        self.steps = step
        refresh_hot(self.table, local)

    def close(self) -> None:
        """Detach the shared state segments (the last process to detach removes them)."""
        for segment in self.segments:
            segment.close()
        self.segments = []

    # ---- state ----

    def settings(self) -> dict:
        """The hyper-parameters a state dict records."""
        return {"lr": self.lr}

    def state_dict(self) -> dict:
        """Copies of the state arrays, the step count and the hyper-parameters."""
        return {"optimizer": self.name, "steps": self.steps,
                "shape": [self.table.num_rows, self.table.head_dim],
                "settings": self.settings(),
                "state": {key: host_copy(array) for key, array in self.state.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``'s state (copied in place); a ValueError for another
        optimizer or table shape, before anything changes."""
        if not isinstance(state, dict) or state.get("optimizer") != self.name:
            got = state.get("optimizer") if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"state is not a {self.name} state dict (got {got!r})")
        shape = [self.table.num_rows, self.table.head_dim]
        if list(state.get("shape", ())) != shape:
            raise ValueError(f"state is for a table of shape {state.get('shape')}, this one "
                             f"is {shape}")
        arrays = state.get("state", {})
        for key, array in self.state.items():
            given = np.asarray(arrays.get(key))
            if given.shape != array.shape:
                raise ValueError(f"state[{key!r}] must have shape {array.shape}, got "
                                 f"{given.shape}")
        for key, array in self.state.items():
            copy_into(array, np.asarray(arrays[key], np.float32))
        self.steps = int(state["steps"])


class SGD(DecayRules, RowOptimizer):
    """``w -= lr * g`` (float32); optional weight decay (``"l2"``: ``g += weight_decay * w``
    first; ``"decoupled"``: ``w = (1 - lr * weight_decay) * w - lr * g``) and ``max_norm``."""

    kind = updates_numba.SGD
    name = "sgd"

    def __init__(self, table, lr: float, weight_decay: float = 0.0, *,
                 weight_decay_mode: str = "l2", max_norm: float | None = None,
                 stochastic_rounding: bool = False, seed: int = 0):
        self.set_rules(weight_decay, weight_decay_mode, max_norm)
        super().__init__(table, lr, stochastic_rounding=stochastic_rounding, seed=seed)

    def hyper(self, step: int) -> np.ndarray:
        return self.rules_hyper()

    def settings(self) -> dict:
        return {"lr": self.lr, **self.rules_settings()}


class RowwiseAdagrad(DecayRules, RowOptimizer):
    """One float32 per row: ``s += mean(g * g)`` (the mean summed in float64), ``w -= lr /
    (sqrt(s) + eps) * g``; weight decay ``"l2"`` (``weight_decay * w`` added to ``g`` first)
    or ``"decoupled"`` (``w = (1 - lr * weight_decay) * w - m * g``), and ``max_norm``."""

    kind = updates_numba.ROWWISE_ADAGRAD
    name = "rowwise_adagrad"
    state_widths = (("sum", True),)

    def __init__(self, table, lr: float, eps: float = 1e-8, weight_decay: float = 0.0, *,
                 weight_decay_mode: str = "l2", max_norm: float | None = None,
                 stochastic_rounding: bool = False, seed: int = 0):
        self.eps = finite_number("eps", eps)
        self.set_rules(weight_decay, weight_decay_mode, max_norm)
        super().__init__(table, lr, stochastic_rounding=stochastic_rounding, seed=seed)

    def hyper(self, step: int) -> np.ndarray:
        return self.rules_hyper(self.eps)

    def settings(self) -> dict:
        return {"lr": self.lr, "eps": self.eps, **self.rules_settings()}


class Adam(RowOptimizer):
    """Adam on the rows a step touches; ``rowwise=False`` is ``torch.optim.SparseAdam``'s
    arithmetic (the same bits), ``rowwise=True`` keeps one first and second moment per row."""

    kind = updates_numba.ADAM

    def __init__(self, table, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 rowwise: bool = False, *, stochastic_rounding: bool = False, seed: int = 0):
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"betas must be a pair, got {betas!r}")
        self.betas = (finite_number("betas[0]", betas[0], 0.0, 1.0),
                      finite_number("betas[1]", betas[1], 0.0, 1.0))
        self.eps = finite_number("eps", eps)
        self.rowwise = bool(rowwise)
        self.kind = updates_numba.ROWWISE_ADAM if self.rowwise else updates_numba.ADAM
        self.name = "rowwise_adam" if self.rowwise else "adam"
        self.state_widths = (("exp_avg", self.rowwise), ("exp_avg_sq", self.rowwise))
        super().__init__(table, lr, stochastic_rounding=stochastic_rounding, seed=seed)

    def hyper(self, step: int) -> np.ndarray:
        beta1, beta2 = self.betas
        step_size = self.lr * math.sqrt(1 - beta2**step) / (1 - beta1**step)
        return hyper_array(self.lr, self.eps, adam=(1 - beta1, 1 - beta2, step_size))

    def settings(self) -> dict:
        return {"lr": self.lr, "betas": list(self.betas), "eps": self.eps,
                "rowwise": self.rowwise}
