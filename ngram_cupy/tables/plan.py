"""Which layers' tables go to GPU memory, which to pinned host memory, and which fit nowhere.

Given each layer's hit-rate curve (the share of lookups its K most used rows serve, from
``ngram-cupy stats --hot-rows``), a host layer may also get a hot-row tier in GPU memory: the plan
then splits the GPU budget between resident tables and hot tiers to minimise the bytes read from
host memory per token.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ..codecs.records import record_bytes
from ..formats import storage_format
from ..hashing.layout import LayerLayout
from .hot_rows import map_nbytes
from .table import EmbeddingTable

GPU, HOST, NONE = "gpu", "host", "none"


def format_bytes(nbytes: int) -> str:
    """Bytes in binary units, e.g. ``47.68 GiB``."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class LayerPlacement:
    """One table: its name, its size in bytes, and where it goes (gpu, host or none); a host
    table may have ``hot_rows`` rows in a GPU tier of ``hot_nbytes`` (rows and slot map) that
    serve ``hit_share`` of its lookups, leaving ``host_bytes_per_token`` read from host memory."""

    name: str
    nbytes: int
    where: str
    hot_rows: int = 0
    hot_nbytes: int = 0
    hit_share: float = 0.0
    host_bytes_per_token: float = 0.0

    @property
    def gpu_nbytes(self) -> int:
        """GPU memory it takes: the table when resident, else its hot tier."""
        return self.nbytes if self.where == GPU else self.hot_nbytes


@dataclass(frozen=True)
class PlacementPlan:
    """The placement of every table within a GPU and a host memory budget; with
    ``processes_per_node > 1`` host tables are one shared copy per node (``"shared"``)."""

    layers: tuple[LayerPlacement, ...]
    gpu_budget_bytes: int
    host_budget_bytes: int
    processes_per_node: int = 1

    def __getitem__(self, name) -> str:
        """Where the table called ``name`` goes."""
        for layer in self.layers:
            if layer.name == str(name):
                return layer.where
        raise KeyError(name)

    def placement(self, name) -> str:
        """The ``EmbeddingTable`` / ``load_ngram_embedding`` placement of the table called
        ``name``: ``"gpu"``, ``"pinned"``, or ``"shared"`` for a host table of a node with
        several processes; a ValueError for a table that fits nowhere."""
        where = self[name]
        if where == NONE:
            raise ValueError(f"table {name} fits in neither budget")
        return "gpu" if where == GPU else "shared" if self.processes_per_node > 1 else "pinned"

    def names(self, where: str) -> list[str]:
        """The tables placed in ``where`` (gpu, host or none), in order."""
        return [layer.name for layer in self.layers if layer.where == where]

    def bytes_in(self, where: str) -> int:
        """Total bytes placed in ``where`` (GPU: resident tables and hot tiers)."""
        if where == GPU:
            return sum(layer.gpu_nbytes for layer in self.layers)
        return sum(layer.nbytes for layer in self.layers if layer.where == where)

    def hot_rows(self, name) -> int:
        """Hot rows chosen for the table called ``name`` (0: no tier)."""
        return next(layer.hot_rows for layer in self.layers if layer.name == str(name))

    @property
    def host_bytes_per_token(self) -> float:
        """Expected bytes read from host memory per token, over every host table."""
        return sum(layer.host_bytes_per_token for layer in self.layers)

    @property
    def fits(self) -> bool:
        """Whether every table found a place."""
        return not self.names(NONE)

    def summary(self) -> str:
        """A readable multi-line account of the plan, for the command line."""
        total = sum(layer.nbytes for layer in self.layers)
        lines = [f"{len(self.layers)} tables, {format_bytes(total)} in all"]
        for where, budget in ((GPU, self.gpu_budget_bytes), (HOST, self.host_budget_bytes)):
            names = self.names(where)
            lines.append(f"  {where:<4}: {len(names)} tables, {format_bytes(self.bytes_in(where))}"
                         f" of a {format_bytes(budget)} budget"
                         + (f" ({', '.join(names)})" if names else "")
                         + (f", one shared copy for {self.processes_per_node} processes"
                            if where == HOST and names and self.processes_per_node > 1 else ""))
        tiered = [layer for layer in self.layers if layer.hot_rows]
        if tiered:
            lines.append(f"  hot rows: {len(tiered)} host tables, "
                         f"{sum(layer.hot_rows for layer in tiered):,} rows, "
                         f"{format_bytes(sum(layer.hot_nbytes for layer in tiered))} of GPU memory")
            lines.extend(f"    {layer.name}: {layer.hot_rows:,} rows serve "
                         f"{layer.hit_share:.1%} of lookups" for layer in tiered)
        untiered = sum(layer.host_bytes_per_token / (1 - layer.hit_share)
                       for layer in self.layers if layer.where == HOST and layer.hit_share < 1)
        if any(layer.where == HOST for layer in self.layers):
            lines.append(f"  expected host bytes per token: {self.host_bytes_per_token:,.0f}"
                         + (f" ({untiered:,.0f} without hot rows)" if tiered else ""))
        left = self.names(NONE)
        lines.append(f"  does not fit: {len(left)} tables, "
                     f"{format_bytes(self.bytes_in(NONE))}" + (f" ({', '.join(left)})" if left
                                                               else ""))
        return "\n".join(lines)


def table_nbytes(table, dtype=None) -> int:
    """Bytes of one table in memory (a block-scaled format's rows as packed records,
    ``codecs.records``): an int, an ``EmbeddingTable``, a ``LayerLayout`` (stored as ``dtype``,
    default the config's ``ple_embedding_dtype``) or a ``(LayerLayout, dtype)`` pair."""
    if isinstance(table, tuple) and len(table) == 2 and isinstance(table[0], LayerLayout):
        table, dtype = table
    if isinstance(table, EmbeddingTable):
        return table.storage.nbytes  # its records in memory (``nbytes``: a checkpoint's bytes)
    if isinstance(table, LayerLayout):
        dtype = dtype or table.config.ple_embedding_dtype
        if dtype is None:
            raise ValueError("a layout's table size needs a storage dtype: pass dtype= or set "
                             "ple_embedding_dtype in the config")
        fmt = storage_format(dtype)
        values = table.table_nbytes(fmt.itemsize)  # a ValueError without embedding_dim
        if fmt.blocked:  # one packed record a row: NVFP4 head_dim 160, 80 + 10 -> 96 B
            fmt.check_head_dim(table.head_dim)
            return table.padded_rows * record_bytes(fmt, table.head_dim)
        return values
    if isinstance(table, (int, np.integer)) and not isinstance(table, bool) and table >= 0:
        return int(table)
    raise TypeError(f"a table must be a byte count, an EmbeddingTable or a LayerLayout, got "
                    f"{table!r}")


def _table_format(table, dtype=None):
    """The storage ``Format`` of a table as ``table_nbytes`` reads it; None for a byte count
    or a layout without a dtype."""
    if isinstance(table, tuple) and len(table) == 2 and isinstance(table[0], LayerLayout):
        table, dtype = table
    if isinstance(table, EmbeddingTable):
        return table.format
    if isinstance(table, LayerLayout) and (dtype or table.config.ple_embedding_dtype):
        return storage_format(dtype or table.config.ple_embedding_dtype)
    return None


def _default_name(table, index: int) -> str:
    """``layer L`` for layouts, else the position."""
    layout = table[0] if isinstance(table, tuple) else table
    return f"layer {layout.layer}" if isinstance(layout, LayerLayout) else str(index)


def _layer_geometry(table, dtype) -> tuple[int, int, int]:
    """``(rows, row bytes, rows read per token)`` of a layout, for planning its hot tier."""
    if isinstance(table, tuple) and len(table) == 2 and isinstance(table[0], LayerLayout):
        table, dtype = table
    if not isinstance(table, LayerLayout):
        raise ValueError("hit_rates need the table as a LayerLayout (rows, row size and heads "
                         f"per token), got {type(table).__name__}")
    row_bytes = table_nbytes((table, dtype)) // table.padded_rows if table.padded_rows else 0
    return table.padded_rows, row_bytes, table.num_heads


def check_curve(curve, num_rows: int, name: str = "hit_rates") -> list[tuple[int, float]]:
    """A hit-rate curve (``zip(ks, stats.hit_rate_curve(...))``) as sorted ``(K, share)`` points
    with 0 < K <= num_rows (K = 0 points are dropped: no tier) and shares in [0, 1] that never
    fall as K grows; ValueError naming ``name`` otherwise."""
    try:
        points = sorted((int(k), float(share)) for k, share in curve)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a list of (hot rows, hit share) pairs, got "
                         f"{curve!r}") from None
    for k, share in points:
        if not 0 <= k <= num_rows or not 0.0 <= share <= 1.0:
            raise ValueError(f"{name}: ({k}, {share}) needs 0 <= hot rows <= {num_rows} and "
                             "0 <= hit share <= 1")
    if any(b[1] < a[1] for a, b in zip(points, points[1:], strict=False)):
        raise ValueError(f"{name}: hit shares must not fall as the hot rows grow")
    return [(k, share) for k, share in points if k > 0]


@dataclass(frozen=True)
class Option:
    """One way to hold a host layer: ``gpu_nbytes`` of GPU memory for ``traffic`` host bytes
    per token (``hot_rows`` = -1: the whole table resident)."""

    gpu_nbytes: int
    traffic: float
    hot_rows: int
    share: float


def layer_options(nbytes: int, geometry: tuple[int, int, int], curve) -> list[Option]:
    """A host layer's options: no tier, a tier of each point ``(K, share)`` of its checked curve
    (K rows and the slot map), and the whole table in GPU memory.

    ``geometry`` is ``(rows, row bytes, rows read per token)``."""
    rows, row_bytes, heads = geometry
    per_token = float(heads * row_bytes)
    options = [Option(0, per_token, 0, 0.0)]
    options += [Option(k * row_bytes + map_nbytes(rows), per_token * (1 - share), k, share)
                for k, share in curve]
    options.append(Option(nbytes, 0.0, -1, 1.0))
    return options


def lower_hull(options: list[Option]) -> list[Option]:
    """The options worth a greedy step, cheapest first: the lower convex hull of (GPU bytes,
    traffic), so each step saves less per byte than the one before."""
    hull: list[Option] = []
    for option in sorted(options, key=lambda o: (o.gpu_nbytes, o.traffic)):
        if hull and option.traffic >= hull[-1].traffic:
            continue  # costs more, saves nothing more
        while len(hull) >= 2 and _slope(hull[-2], hull[-1]) <= _slope(hull[-1], option):
            hull.pop()  # the step to hull[-1] saves less per byte than the one after it
        hull.append(option)
    return hull


def _slope(a: Option, b: Option) -> float:
    """Host bytes per token saved per GPU byte, going from option ``a`` to ``b``."""
    return (a.traffic - b.traffic) / max(b.gpu_nbytes - a.gpu_nbytes, 1)


def plan_placement(tables: Mapping | Iterable, gpu_budget_bytes: int, host_budget_bytes: int,
                   dtype=None, hit_rates: Mapping | Sequence | None = None, *,
                   processes_per_node: int = 1) -> PlacementPlan:
    """Place tables in GPU memory, pinned host memory, or nowhere.

    ``processes_per_node``: processes of one node that each hold these tables (data-parallel
    replicas, one per GPU); above 1, ``host_budget_bytes`` is the node's and its host tables go
    to ``"shared"`` memory, one copy for them all (``PlacementPlan.placement``), where private
    pinned copies would take that many times the memory.

    ``tables`` is a mapping of names to tables or a sequence of tables (see ``table_nbytes``);
    budgets are the bytes each memory may give to tables. Without ``hit_rates``: in order, in GPU
    memory while they fit, then in host memory, else none. With ``hit_rates`` (per table, by name
    or position: a list of ``(hot rows K, share of lookups the K most used rows serve)``, or None
    for a table without one; tables with a curve must be ``LayerLayout``s): tables go to host
    memory in order while they fit (the rest to GPU memory while it fits), then the GPU budget
    left is spent greedily on whichever step saves the most host bytes per token per GPU byte:
    a larger hot tier for a host table, or the whole table resident (layouts without a curve:
    resident or not; byte counts without a curve stay where the first pass put them).
    """
    for name, budget in (("gpu_budget_bytes", gpu_budget_bytes),
                         ("host_budget_bytes", host_budget_bytes)):
        if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or budget < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {budget!r}")
    if isinstance(processes_per_node, bool) or not isinstance(processes_per_node, int) \
            or processes_per_node < 1:
        raise ValueError(f"processes_per_node must be a positive integer, got "
                         f"{processes_per_node!r}")
    if isinstance(tables, Mapping):
        named = [(str(name), table) for name, table in tables.items()]
    else:
        named = [(_default_name(table, i), table) for i, table in enumerate(tables)]
    if processes_per_node > 1:
        for name, table in named:
            fmt = _table_format(table, dtype)
            if fmt is not None and fmt.blocked:
                raise ValueError(
                    f"table {name} is {fmt.name}: placement 'shared' holds tables of one array "
                    f"and {fmt.name} rows carry block scales beside them, so a node's "
                    f"processes cannot share it; plan with processes_per_node=1 and one "
                    f"process's host budget (each pins its own copy)")
    if hit_rates is None:
        plan = _plan_in_order(named, int(gpu_budget_bytes), int(host_budget_bytes), dtype)
    else:
        plan = _plan_with_tiers(named, int(gpu_budget_bytes), int(host_budget_bytes), dtype,
                                _curves(named, hit_rates))
    return dataclasses.replace(plan, processes_per_node=processes_per_node)


def _curves(named: list[tuple[str, object]], hit_rates) -> list:
    """Each table's curve (or None), from a mapping by name or a sequence by position."""
    if isinstance(hit_rates, Mapping):
        unknown = set(map(str, hit_rates)) - {name for name, _ in named}
        if unknown:
            raise ValueError(f"hit_rates names tables that are not planned: {sorted(unknown)}")
        by_name = {str(name): curve for name, curve in hit_rates.items()}
        return [by_name.get(name) for name, _ in named]
    curves = list(hit_rates)
    if len(curves) != len(named):
        raise ValueError(f"hit_rates must have one entry per table ({len(named)}), got "
                         f"{len(curves)}")
    return curves


def choose_options(hulls: list[list[Option] | None], gpu_budget: int) -> list[int]:
    """Which option of each hull (None: fixed, 0) to take within ``gpu_budget`` bytes: steps
    in order of host bytes saved per GPU byte over all layers, skipping a step that does not fit
    (and that layer's later ones). Within the largest single step of the optimum."""
    chosen = [0] * len(hulls)
    steps = [(-_slope(hull[0], hull[1]), i) for i, hull in enumerate(hulls)
             if hull is not None and len(hull) > 1]
    heapq.heapify(steps)
    free = gpu_budget
    while steps:
        _, i = heapq.heappop(steps)
        hull, at = hulls[i], chosen[i]
        cost = hull[at + 1].gpu_nbytes - hull[at].gpu_nbytes
        if cost > free:
            continue
        free -= cost
        chosen[i] = at + 1
        if at + 2 < len(hull):
            heapq.heappush(steps, (-_slope(hull[at + 1], hull[at + 2]), i))
    return chosen


def _plan_in_order(named, gpu_budget: int, host_budget: int, dtype) -> PlacementPlan:
    """GPU memory while tables fit, then host memory, else none (no hot tiers)."""
    free = {GPU: gpu_budget, HOST: host_budget}
    layers = []
    for name, table in named:
        nbytes = table_nbytes(table, dtype)
        where = next((w for w in (GPU, HOST) if nbytes <= free[w]), NONE)
        if where != NONE:
            free[where] -= nbytes
        traffic = 0.0
        if where == HOST and isinstance(table, (LayerLayout, tuple)):
            _, row_bytes, heads = _layer_geometry(table, dtype)
            traffic = float(heads * row_bytes)
        layers.append(LayerPlacement(name, nbytes, where, host_bytes_per_token=traffic))
    return PlacementPlan(tuple(layers), gpu_budget, host_budget)


def _plan_with_tiers(named, gpu_budget: int, host_budget: int, dtype, curves) -> PlacementPlan:
    """Host first, then greedy upgrades of GPU memory by host bytes saved per GPU byte."""
    free = {GPU: gpu_budget, HOST: host_budget}
    sizes, wheres, hulls = [], [], []
    for (name, table), curve in zip(named, curves, strict=True):
        nbytes = table_nbytes(table, dtype)
        where = next((w for w in (HOST, GPU) if nbytes <= free[w]), NONE)
        if where != NONE:
            free[where] -= nbytes
        hull = None  # a byte count without a curve: its traffic is unknown, it stays
        if curve is not None or isinstance(table, (LayerLayout, tuple)):
            geometry = _layer_geometry(table, dtype)
            points = [] if curve is None else check_curve(curve, geometry[0],
                                                          f"hit_rates[{name!r}]")
            hull = lower_hull(layer_options(nbytes, geometry, points))
        sizes.append(nbytes)
        wheres.append(where)
        hulls.append(hull)
    chosen = choose_options([hull if where == HOST else None
                             for hull, where in zip(hulls, wheres, strict=True)], free[GPU])
    layers = []
    for (name, _), nbytes, where, hull, at in zip(named, sizes, wheres, hulls, chosen,
                                                  strict=True):
        if where != HOST or hull is None:
            layers.append(LayerPlacement(name, nbytes, where))
            continue
        option = hull[at]
        if option.hot_rows < 0:
            layers.append(LayerPlacement(name, nbytes, GPU))
        else:
            layers.append(LayerPlacement(name, nbytes, HOST, option.hot_rows, option.gpu_nbytes,
                                         option.share, option.traffic))
    return PlacementPlan(tuple(layers), gpu_budget, host_budget)
