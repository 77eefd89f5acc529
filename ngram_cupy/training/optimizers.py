"""Optimizers that update an ``EmbeddingTable``'s rows in place, their state beside the rows.

Each step takes sparse row gradients (``step``) or the lookup's output gradient
(``step_from_output_grad``: the backward fused into the update, no ``[U, D]`` gradient made).
Every check runs before any row changes: a refused step leaves rows and state as they were.
With ``asynchronous=True`` a step copies its ids and returns; a worker thread checks and applies
it (``worker.py``), reading the gradient in place (the caller leaves it unchanged until its next
call), and lookups of the table wait for it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from ..runtime.backends import HOST, bind
from ..runtime.jitable import read_only
from . import backward_numba, gpu_steps, updates_numba
from .inputs import check_finite, check_owned_ids, check_row_sums, flat_inputs
from .sparse_rows import SparseRows
from .table_rows import (
    check_trainable,
    copy_into,
    host_copy,
    refresh_hot,
    state_array,
    writable_rows,
)
from .worker import UpdateWorker


def finite_number(name: str, value, low: float = 0.0, high: float = math.inf,
                  closed_high: bool = False, open_low: bool = False) -> float:
    """``value`` as a float in ``[low, high)`` (``(`` when ``open_low``, ``]`` when
    ``closed_high``), finite in float32 too (the updates' arithmetic); errors name it."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    value = float(value)
    above = low < value if open_low else low <= value
    inside = above and (value <= high if closed_high else value < high)
    if not math.isfinite(value) or not inside:
        raise ValueError(f"{name} must be finite and in {'(' if open_low else '['}{low}, {high}"
                         f"{']' if closed_high else ')'}, got {value}")
    with np.errstate(over="ignore"):
        if not np.isfinite(np.float32(value)):
            raise ValueError(f"{name} must be finite in float32 (the updates' arithmetic), got "
                             f"{value}")
    return value


def check_betas(betas) -> tuple[float, float]:
    """Adam's ``(beta1, beta2)``, each in ``[0, 1)``."""
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be a pair, got {betas!r}")
    return (finite_number("betas[0]", betas[0], 0.0, 1.0),
            finite_number("betas[1]", betas[1], 0.0, 1.0))


def check_flag(name: str, value) -> bool:
    """A bool setting (a state dict's ``stochastic_rounding``, ``rowwise``)."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def check_seed(value) -> int:
    """A stochastic-rounding seed: an integer, kept modulo 2**64."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"seed must be an integer, got {value!r}")
    return int(value) & ((1 << 64) - 1)


def check_mode(value) -> str:
    """A weight decay mode: ``"l2"`` or ``"decoupled"``."""
    if value not in WEIGHT_DECAY_MODES:
        raise ValueError(f"weight_decay_mode must be one of {WEIGHT_DECAY_MODES}, got {value!r}")
    return value


def check_max_norm(value) -> float | None:
    """A row norm clamp: None, or a positive float32 number."""
    if value is None:
        return None
    value = finite_number("max_norm", value)
    if not np.float32(value) > 0:
        raise ValueError(f"max_norm must be positive (None: no clamp), got {value}")
    return value


WEIGHT_DECAY_MODES = ("l2", "decoupled")


def hyper_array(lr: float, eps: float = 0.0, decay: float = 0.0,
                adam: tuple[float, float, float] = (0.0, 0.0, 0.0), max_norm: float | None = None,
                decoupled: bool = False) -> np.ndarray:
    """The float32 hyper-parameters ``update_rows`` reads, in its slot order."""
    hyper = np.zeros(updates_numba.HYPER_SIZE, np.float32)
    with np.errstate(over="ignore"):  # an overflow is +-inf, refused by ``step_hyper``
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
        self.weight_decay_mode = check_mode(weight_decay_mode)
        self.max_norm = check_max_norm(max_norm)

    def rules_hyper(self, eps: float = 0.0) -> np.ndarray:
        """``hyper_array`` with the learning rate, ``eps`` and the three rules."""
        return hyper_array(self.lr, eps, self.weight_decay, max_norm=self.max_norm,
                           decoupled=self.weight_decay_mode == "decoupled")

    def rules_settings(self) -> dict:
        """The rules as a state dict records them."""
        return {"weight_decay": self.weight_decay, "weight_decay_mode": self.weight_decay_mode,
                "max_norm": self.max_norm}


# How each setting a state dict records is checked (as the constructors check it).
SETTINGS = {"lr": lambda value: finite_number("lr", value),
            "eps": lambda value: finite_number("eps", value, open_low=True),
            "weight_decay": lambda value: finite_number("weight_decay", value),
            "weight_decay_mode": check_mode, "max_norm": check_max_norm, "betas": check_betas,
            "rowwise": lambda value: check_flag("rowwise", value),
            "stochastic_rounding": lambda value: check_flag("stochastic_rounding", value),
            "seed": check_seed}
# State arrays that are sums of squares: a negative value would give NaN rows.
SQUARES = ("sum", "exp_avg_sq")
MAX_STEPS = 2**63  # a step count the update kernels' 64-bit counter holds, next step too


class RowOptimizer:
    """The common part: the table's writable rows, named float32 state arrays, a step count;
    ``asynchronous=True`` applies the steps on a worker thread (``synchronize`` waits)."""

    kind = -1
    name = ""
    state_widths: tuple[tuple[str, bool], ...] = ()  # (name, one value per row)

    def __init__(self, table, lr: float, *, stochastic_rounding: bool = False, seed: int = 0,
                 asynchronous: bool = False):
        self.table = table
        self.lr = finite_number("lr", lr)
        self.rows = writable_rows(table)
        self.on_gpu = table.storage.cold.device_resident  # rows and state in GPU memory
        self.code = table.format.code  # the row format the kernel loads and stores
        self.stochastic_rounding = bool(stochastic_rounding)
        self.seed = check_seed(seed)
        self.steps = 0
        self.closed = False
        self.state: dict[str, np.ndarray] = {}
        self.segments = []  # shared state segments, attached while the optimizer lives
        for key, rowwise in self.state_widths:
            array, segment = state_array(table, f"{self.name}.{key}",
                                         1 if rowwise else table.head_dim)
            self.state[key] = array
            if segment is not None:
                self.segments.append(segment)
        if not isinstance(asynchronous, bool):
            raise TypeError(f"asynchronous must be True or False, got {asynchronous!r}")
        self.worker = UpdateWorker() if asynchronous else None
        if self.worker is not None:
            table.writers.workers.append(self.worker)

    def __setattr__(self, name: str, value) -> None:
        """A setting assigned later (a learning-rate schedule) is checked as the constructor
        checks it: a bad value is refused (naming it) before it can poison a step."""
        super().__setattr__(name, SETTINGS[name](value) if name in SETTINGS else value)

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
        self.check_open()
        self.step_hyper()
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
        if self.worker is not None:
            indices = indices.copy()  # grads.values is read in place
        self.issue(indices, lambda hyper: self.step_rows(indices, values, hyper))

    def step_rows(self, indices: np.ndarray, values: np.ndarray, hyper: np.ndarray) -> None:
        """``step``'s data checks and update, on shape-checked host arrays."""
        if indices.size > 1 and not bool((np.diff(indices) > 0).all()):
            raise ValueError("grads.indices must be sorted and unique (embedding_backward's)")
        start = self.table.row_start
        check_owned_ids(indices, self.table, "grads.indices")
        check_finite(values)
        local = indices.astype(np.int64) - start
        count = np.arange(local.shape[0] + 1, dtype=np.int64)
        self.apply(local, count[:-1], count, np.ascontiguousarray(values), hyper)

    def step_from_output_grad(self, ids, grad_out) -> None:
        """Backward and update in one pass: ``ids`` ``[N]`` / ``[T, H]`` (global rows) and the
        lookup's output gradient ``grad_out`` (as ``embedding_backward`` takes them)."""
        inputs = self.step_inputs(ids, grad_out)
        if callable(inputs):
            inputs()
            return
        ids, flat, grad = inputs
        self.issue(flat, lambda hyper: self.step_ids(ids, flat, grad)(hyper))

    def checked_step(self, ids, grad_out) -> Callable[[], None]:
        """Every check of ``step_from_output_grad(ids, grad_out)`` (errors raised here, nothing
        changed), then the update to run: ranks that must all step or all refuse check first
        (the GPU paths check inside the update). Pending asynchronous updates land first."""
        self.synchronize()
        inputs = self.step_inputs(ids, grad_out)
        if callable(inputs):
            return inputs
        ids, flat, grad = inputs
        update = self.step_ids(ids, flat, grad)
        return lambda: self.issue(flat, update)

    def step_inputs(self, ids, grad_out):
        """A step's shape-checked host ``(ids, flat ids, gradient [N, head_dim])``, copied
        where a worker reads them later; for a GPU table or GPU gradients, the whole step."""
        self.check_open()
        self.step_hyper()
        if self.on_gpu:
            return lambda: gpu_steps.step_from_output_grad(self, ids, grad_out)
        call = bind(ids=ids, grad_out=grad_out)
        if call.side is not HOST:  # summed on the GPU, the distinct rows applied here
            return lambda: self.step(gpu_steps.host_rows_of_device_grad(self, call))
        flat, grad = flat_inputs(call["ids"], call["grad_out"], call.formats.get("grad_out"))
        if grad.shape[1] != self.table.head_dim:
            raise ValueError(f"grad_out has {grad.shape[1]} values per head, the table "
                             f"{self.table.head_dim}")
        ids = call["ids"]
        if self.worker is not None:
            ids = ids.copy()  # the caller may reuse its ids buffer; grad_out is read in place
            flat = ids.reshape(-1)
        return ids, flat, grad

    def step_ids(self, ids, flat: np.ndarray, grad: np.ndarray) -> Callable[[np.ndarray], None]:
        """The data checks of a step on shape-checked host arrays (errors raised here), then
        its update to run with the step's hyper-parameters."""
        start, rows = self.table.row_start, self.table.num_rows
        check_owned_ids(ids, self.table)
        check_finite(grad)
        order, unique, starts = backward_numba.sorted_order(flat.astype(np.int64, copy=False),
                                                            start, rows)
        check_row_sums(grad, order, starts)
        return lambda hyper: self.apply(unique - start, order, starts,
                                        np.ascontiguousarray(grad), hyper)

    def issue(self, ids, update: Callable[[np.ndarray], None]) -> None:
        """Run ``update`` of the rows ``ids``: now, or on the worker (``asynchronous``) once
        the previous update is applied (its error, if any, is raised instead). Other writers'
        pending updates of the table land first; the hyper-parameters are read now, so a
        setting changed after this call (a schedule) applies from the next step."""
        self.table.writers.settle()  # another optimizer's worker may be writing these rows
        if self.worker is not None:
            self.worker.wait()
        hyper = self.step_hyper()
        self.table.writers.wrote(ids)  # a pending prefetch gathers these rows again
        if self.worker is None:
            update(hyper)
        else:
            self.worker.submit(lambda: update(hyper))

    def synchronize(self) -> None:
        """Wait until every issued update is applied; an error a pending update raised (it
        changed nothing) is raised here. Other writers' pending updates of the table land too
        (their errors stay for them), so the rows read next hold every update issued."""
        if self.worker is not None:
            self.worker.wait()
        self.table.writers.settle()

    def apply(self, local, order, starts, grad, hyper: np.ndarray) -> None:
        """Run the update kernel on checked inputs with the step's ``hyper``, then refresh hot
        copies (an empty batch is a step that changes no row: the count still advances, as for
        one process stepping on every rank's batch)."""
        self.check_open()
        step = self.steps + 1
        empty = np.zeros((0, 1), np.float32)
        first = self.state.get(self.state_widths[0][0], empty) if self.state_widths else empty
        second = self.state.get(self.state_widths[1][0], empty) if len(self.state_widths) > 1 \
            else empty
        if local.size:  # an empty step writes nothing
            self.table.storage.cold.will_write()
        updates_numba.update_rows(self.kind, self.rows, self.code, self.table.row_start, local,
                                  order, starts, read_only(grad), first, second, hyper,
                                  self.stochastic_rounding, np.uint64(self.seed),
                                  np.uint64(step))
        self.steps = step
        refresh_hot(self.table, local)

    def step_hyper(self) -> np.ndarray:
        """The next step's float32 hyper-parameters; a ValueError when one overflows."""
        step = self.steps + 1
        hyper = self.hyper(step)
        if not np.isfinite(hyper).all():
            raise ValueError(f"step {step}'s hyper-parameters overflow float32 ({self.settings()}"
                             "): the step is refused and no row changed")
        return hyper

    def check_open(self) -> None:
        """A ValueError, before anything changes, once the optimizer or its table was closed."""
        if self.closed:
            raise ValueError("the optimizer is closed: it steps and loads no more")
        check_trainable(self.table)

    def close(self) -> None:
        """Finish the pending update (raising its error) and detach the shared state segments
        (the last process to detach removes them); later steps and loads are refused."""
        try:
            if self.worker is not None:
                self.worker.close()
                self.table.writers.workers.remove(self.worker)
                self.worker = None
        finally:
            for segment in self.segments:
                segment.close()
            self.segments = []
            self.closed = True

    # ---- state ----

    def settings(self) -> dict:
        """The hyper-parameters a state dict records (``load_state_dict`` restores them)."""
        return {"lr": self.lr, "stochastic_rounding": self.stochastic_rounding,
                "seed": self.seed}

    def state_dict(self) -> dict:
        """Copies of the state arrays, the step count and the hyper-parameters (after every
        issued update)."""
        self.synchronize()
        return {"optimizer": self.name, "steps": self.steps,
                "shape": [self.table.num_rows, self.table.head_dim],
                "settings": self.settings(),
                "state": {key: host_copy(array) for key, array in self.state.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``'s state arrays, step count and settings (as torch's
        optimizers restore theirs: a resumed run continues with the same bits); every part is
        checked first, so a ValueError (another optimizer, table shape or version, a missing or
        bad part, a closed optimizer or table) changes nothing."""
        self.check_open()
        if not isinstance(state, dict) or state.get("optimizer") != self.name:
            got = state.get("optimizer") if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"state is not a {self.name} state dict (got {got!r})")
        self.synchronize()
        shape = [self.table.num_rows, self.table.head_dim]
        if list(state.get("shape", ())) != shape:
            raise ValueError(f"state is for a table of shape {state.get('shape')}, this one "
                             f"is {shape}")
        steps = state.get("steps")
        if (isinstance(steps, bool) or not isinstance(steps, (int, np.integer))
                or not 0 <= steps < MAX_STEPS):  # the kernels count steps in 64 bits
            raise ValueError(f"state['steps'] must be a step count (an integer in [0, 2**63)), "
                             f"got {steps!r}")
        settings = state.get("settings")
        if not isinstance(settings, dict) or set(settings) != set(self.settings()):
            raise ValueError(f"state['settings'] must hold {sorted(self.settings())} (a state "
                             f"of another version?), got {settings!r}")
        checked = {key: SETTINGS[key](value) for key, value in settings.items()}
        if "rowwise" in checked and checked["rowwise"] != self.rowwise:
            raise ValueError(f"state['settings'] has rowwise={checked['rowwise']}, this "
                             f"optimizer {self.rowwise}")
        arrays = state.get("state", {})
        given = {}
        for key, array in self.state.items():
            value = np.asarray(arrays.get(key), np.float32)
            if value.shape != array.shape:
                raise ValueError(f"state[{key!r}] must have shape {array.shape}, got "
                                 f"{value.shape}")
            if not np.isfinite(value).all() or (key in SQUARES and (value < 0).any()):
                raise ValueError(f"state[{key!r}] holds NaN, infinite"
                                 f"{' or negative' if key in SQUARES else ''} values")
            given[key] = value
        for key, array in self.state.items():
            copy_into(array, given[key])
        for key, value in checked.items():
            setattr(self, key, value)
        self.steps = int(steps)


class SGD(DecayRules, RowOptimizer):
    """``w -= lr * g`` (float32); optional weight decay (``"l2"``: ``g += weight_decay * w``
    first; ``"decoupled"``: ``w = (1 - lr * weight_decay) * w - lr * g``) and ``max_norm``."""

    kind = updates_numba.SGD
    name = "sgd"

    def __init__(self, table, lr: float, weight_decay: float = 0.0, *,
                 weight_decay_mode: str = "l2", max_norm: float | None = None,
                 stochastic_rounding: bool = False, seed: int = 0, asynchronous: bool = False):
        self.set_rules(weight_decay, weight_decay_mode, max_norm)
        super().__init__(table, lr, stochastic_rounding=stochastic_rounding, seed=seed,
                         asynchronous=asynchronous)

    def hyper(self, step: int) -> np.ndarray:
        return self.rules_hyper()

    def settings(self) -> dict:
        return {**super().settings(), **self.rules_settings()}


class RowwiseAdagrad(DecayRules, RowOptimizer):
    """One float32 per row: ``s += mean(g * g)`` (the mean summed in float64), ``w -= lr /
    (sqrt(s) + eps) * g``; weight decay ``"l2"`` (``weight_decay * w`` added to ``g`` first)
    or ``"decoupled"`` (``w = (1 - lr * weight_decay) * w - m * g``), and ``max_norm``."""

    kind = updates_numba.ROWWISE_ADAGRAD
    name = "rowwise_adagrad"
    state_widths = (("sum", True),)

    def __init__(self, table, lr: float, eps: float = 1e-8, weight_decay: float = 0.0, *,
                 weight_decay_mode: str = "l2", max_norm: float | None = None,
                 stochastic_rounding: bool = False, seed: int = 0, asynchronous: bool = False):
        self.eps = SETTINGS["eps"](eps)
        self.set_rules(weight_decay, weight_decay_mode, max_norm)
        super().__init__(table, lr, stochastic_rounding=stochastic_rounding, seed=seed,
                         asynchronous=asynchronous)

    def hyper(self, step: int) -> np.ndarray:
        return self.rules_hyper(self.eps)

    def settings(self) -> dict:
        return {**super().settings(), "eps": self.eps, **self.rules_settings()}


class Adam(RowOptimizer):
    """Adam on the rows a step touches; ``rowwise=False`` is ``torch.optim.SparseAdam``'s
    arithmetic (the same bits), ``rowwise=True`` keeps one first and second moment per row."""

    kind = updates_numba.ADAM
    name = "adam"  # "rowwise_adam" for one moment pair per row

    def __init__(self, table, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 rowwise: bool = False, *, stochastic_rounding: bool = False, seed: int = 0,
                 asynchronous: bool = False):
        self.betas = check_betas(betas)
        self.eps = SETTINGS["eps"](eps)
        self.rowwise = bool(rowwise)
        self.kind = updates_numba.ROWWISE_ADAM if self.rowwise else updates_numba.ADAM
        self.name = "rowwise_adam" if self.rowwise else "adam"
        self.state_widths = (("exp_avg", self.rowwise), ("exp_avg_sq", self.rowwise))
        super().__init__(table, lr, stochastic_rounding=stochastic_rounding, seed=seed,
                         asynchronous=asynchronous)

    def hyper(self, step: int) -> np.ndarray:
        beta1, beta2 = self.betas
        step_size = self.lr * math.sqrt(1 - beta2**step) / (1 - beta1**step)
        return hyper_array(self.lr, self.eps, adam=(1 - beta1, 1 - beta2, step_size))

    def settings(self) -> dict:
        return {**super().settings(), "betas": list(self.betas), "eps": self.eps,
                "rowwise": self.rowwise}


# The row optimizers by the names ``fused_optimizer`` and ``use_ngram_cupy`` take: their own.
OPTIMIZERS = {optimizer.name: optimizer for optimizer in (SGD, RowwiseAdagrad, Adam)}
