"""Which layers' tables go to GPU memory, which to pinned host memory, and which fit nowhere."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from .formats import storage_format
from .layout import LayerLayout
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
    """One table: its name, its size in bytes, and where it goes (gpu, host or none)."""

    name: str
    nbytes: int
    where: str


@dataclass(frozen=True)
class PlacementPlan:
    """The placement of every table within a GPU and a host memory budget."""

    layers: tuple[LayerPlacement, ...]
    gpu_budget_bytes: int
    host_budget_bytes: int

    def __getitem__(self, name) -> str:
        """Where the table called ``name`` goes."""
        for layer in self.layers:
            if layer.name == str(name):
                return layer.where
        raise KeyError(name)

    def names(self, where: str) -> list[str]:
        """The tables placed in ``where`` (gpu, host or none), in order."""
        return [layer.name for layer in self.layers if layer.where == where]

    def bytes_in(self, where: str) -> int:
        """Total bytes placed in ``where``."""
        return sum(layer.nbytes for layer in self.layers if layer.where == where)

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
                         + (f" ({', '.join(names)})" if names else ""))
        left = self.names(NONE)
        lines.append(f"  does not fit: {len(left)} tables, "
                     f"{format_bytes(self.bytes_in(NONE))}" + (f" ({', '.join(left)})" if left
                                                               else ""))
        return "\n".join(lines)


def table_nbytes(table, dtype=None) -> int:
    """Bytes of one table: an int, an ``EmbeddingTable``, a ``LayerLayout`` (stored as ``dtype``,
    default the config's ``ple_embedding_dtype``) or a ``(LayerLayout, dtype)`` pair."""
    if isinstance(table, tuple) and len(table) == 2 and isinstance(table[0], LayerLayout):
        table, dtype = table
    if isinstance(table, EmbeddingTable):
        return table.nbytes
    if isinstance(table, LayerLayout):
        dtype = dtype or table.config.ple_embedding_dtype
        if dtype is None:
            raise ValueError("a layout's table size needs a storage dtype: pass dtype= or set "
                             "ple_embedding_dtype in the config")
        return table.table_nbytes(storage_format(dtype).itemsize)
    if isinstance(table, (int, np.integer)) and not isinstance(table, bool) and table >= 0:
        return int(table)
    raise TypeError(f"a table must be a byte count, an EmbeddingTable or a LayerLayout, got "
                    f"{table!r}")


def _default_name(table, index: int) -> str:
    """``layer L`` for layouts, else the position."""
    layout = table[0] if isinstance(table, tuple) else table
    return f"layer {layout.layer}" if isinstance(layout, LayerLayout) else str(index)


def plan_placement(tables: Mapping | Iterable, gpu_budget_bytes: int, host_budget_bytes: int,
                   dtype=None) -> PlacementPlan:
    """Place tables in order: in GPU memory while they fit, then in pinned host memory, else none.

    ``tables`` is a mapping of names to tables or a sequence of tables (see ``table_nbytes``);
    budgets are the bytes each memory may give to tables.
    """
    for name, budget in (("gpu_budget_bytes", gpu_budget_bytes),
                         ("host_budget_bytes", host_budget_bytes)):
        if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or budget < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {budget!r}")
    if isinstance(tables, Mapping):
        named = [(str(name), table) for name, table in tables.items()]
    else:
        named = [(_default_name(table, i), table) for i, table in enumerate(tables)]
    free = {GPU: int(gpu_budget_bytes), HOST: int(host_budget_bytes)}
    layers = []
    for name, table in named:
        nbytes = table_nbytes(table, dtype)
        where = next((w for w in (GPU, HOST) if nbytes <= free[w]), NONE)
        if where != NONE:
            free[where] -= nbytes
        layers.append(LayerPlacement(name, nbytes, where))
    return PlacementPlan(tuple(layers), int(gpu_budget_bytes), int(host_budget_bytes))
