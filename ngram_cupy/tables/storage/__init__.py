"""Table storage: one class per placement, all with the same small interface.

A storage holds a table's local rows ``[0, num_rows)`` as the bits of one format (``format``),
in one kind of memory. ``EmbeddingTable`` is a thin front over a storage: it checks arguments,
owns the global geometry (``row_start``, ``total_rows``), the scale and the prefetch protocol, and
asks the storage for everything that depends on where the rows live.

The interface (``Storage`` in ``base``; each placement is one module: ``cpu``, ``gpu``,
``pinned``, ``shared``, ``mapped``, ``disk``, ``tiered``):

- ``placement``: the storage's kind (``"cpu"``, ``"gpu"``, ``"pinned"``, ``"shared"``,
  ``"mmap"``, ...);
  ``format``, ``num_rows``, ``head_dim``; ``nbytes`` (bytes of memory it holds).
- ``reads(side) -> bool``: whether lookups with ids on ``side`` (``backends.HOST`` /
  ``backends.DEVICE``) can gather from it.
- ``writable``: whether ``write_rows`` may be called.
- ``write_rows(local_start, rows, scales=None)``: copy a raw-bits block (NumPy or CuPy,
  ``[n, head_dim]`` of ``format.raw``; a block-scaled format's packed ``[n, head_dim / pack]``
  bytes with their ``[n, head_dim / block]`` uint8 block scales) into local rows
  ``[local_start, local_start + n)``. When it returns, the rows are visible to every later
  gather, on any stream and in any CUDA graph replay.
- ``host_scales`` / ``device_scales``: the block scales beside ``host_view`` / ``device_view``
  (block-scaled formats; else None): every placement carries them with the rows. Every
  placement but mapped checkpoints packs them with the rows, one record per row (``packed``:
  ``packed`` is True, ``records`` the host records): the views are then strided views into the
  records, and kernels read them by their row strides (``gather_cupy``) or as whole records
  (``packed.whole_records``).
- ``gather(job: Gather)``: write the dequantised rows of ``job.ids`` into ``job.out`` on
  ``job.side`` (on ``job.stream`` on the GPU, without a host synchronisation); ids outside
  ``[job.row_start, job.row_start + num_rows)`` give zero rows and are never read; with
  ``job.total_rows``, ids outside ``[0, total_rows)`` are an IndexError (``row_ids``).
- ``host_view``: a NumPy view of the rows (of ``format.dtype``) when they are in host memory,
  else None; ``device_view``: the raw ``[num_rows, head_dim]`` CuPy view GPU kernels read (device
  memory, or host memory mapped for the GPU), else None. Kernels outside the storage (the fused
  ids + gather) read ``device_view`` directly, so a storage whose rows are not all at one device
  address (a tiered one) leaves it None, and ``reads`` says which sides its own ``gather``
  serves; such kernels read a tiered storage through ``EmbeddingTable.device_rows_on`` (its cold
  rows and ``device_tier``).
- ``used_on(stream)``: note that a kernel reading ``device_view`` runs on ``stream`` (the fused
  kernel calls it); storages whose memory must outlive such kernels remember it.
- ``close()``: release what the storage holds (registrations); it may be unusable afterwards.
- Optional abilities, with defaults here for every storage (callers ask them, never the class
  or the placement name): ``cold`` (the storage holding the rows themselves: the one under a
  hot tier, else itself), ``device_tier``, ``counters``, ``refresh_hot_rows()`` and
  ``rows_changed(local_rows)`` (a hot tier's), ``page_locked`` (host memory the GPU reads over
  UVA), ``device_resident`` (rows in GPU memory), ``shared_segment`` (the node-wide segment the
  rows are in), ``training_refusal()``, ``training_rows()`` (what a row optimizer updates) and
  ``will_write()`` (called before each update).

A new placement is one more class: a tiered storage (hot rows in GPU memory over a cold storage)
implements the same methods, gathering hot rows itself and the rest through the cold storage,
and ``EmbeddingTable(storage, scale, row_start=..., total_rows=...)`` takes it as it is.

This module is also the registry of placement names (``PLACEMENTS``, the alias ``"host"``), the
one place that turns a name into a storage: ``allocate`` makes the unfilled storage of a name,
``adopt`` wraps a caller's array when it can serve without a copy, and ``place`` builds a
table's storage from a ``RowsSource`` (the mapped files for ``"mmap"``; for ``"shared"`` the
node's segment, filled by the process that creates it, or filled privately first and named by
the rows' content, ``place_filled``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...codecs.records import device_packed_rows, packed_rows
from ...formats import Format
from ...memory.anonymous import anonymous_memory
from ...runtime.backends import DEVICE, HOST, Backend, bind, gpu_available
from ..row_cache import DEFAULT_POLICY
from .base import Gather, Storage, placement_list
from .cpu import CpuStorage
from .disk import DiskBlock, DiskStorage
from .gpu import GpuStorage
from .mapped import MappedStorage
from .pinned import PinnedStorage
from .shared import SharedStorage, block_scales_refusal, content_key

__all__ = ["PLACEMENTS", "TABLE_PLACEMENT", "Gather", "Placement", "RowsSource", "Storage",
           "adopt", "allocate", "canonical_placement", "find_placement", "place", "place_filled",
           "placement_list", "placement_named"]


# Asked for explicitly without a GPU: an error, never a quiet fallback.
GPU_REFUSAL = ("placement='gpu' needs CuPy and a CUDA device, and this process has neither: "
               "pass placement='cpu' (or 'pinned', host memory without a GPU)")


def host_rows(num_rows: int, head_dim: int, fmt: Format) -> Storage:
    """Unfilled rows in this process's host memory (in huge pages where offered; a
    block-scaled format's rows and scales packed, one record per row: ``packed``)."""
    shape = (num_rows, fmt.row_width(head_dim))
    scale_shape = (num_rows, fmt.scale_width(head_dim))
    if fmt.blocked and num_rows * head_dim > 0:  # one record per row (``packed``)
        records, rows, scales = packed_rows(num_rows, head_dim, fmt)
        return CpuStorage(rows, fmt, scales, records)
    scales = np.empty(scale_shape, np.uint8) if fmt.blocked else None
    if num_rows * head_dim == 0:
        return CpuStorage(np.empty(shape, fmt.dtype), fmt, scales)
    memory = anonymous_memory(shape[0] * shape[1] * fmt.itemsize)  # huge pages where offered
    return CpuStorage(np.frombuffer(memory, fmt.dtype).reshape(shape), fmt, scales)


def device_rows(num_rows: int, head_dim: int, fmt: Format) -> Storage:
    """Unfilled rows in GPU memory (block-scaled ones packed with their scales)."""
    if not gpu_available():
        raise ValueError(GPU_REFUSAL)
    if fmt.blocked and num_rows * head_dim > 0:
        rows, scales = device_packed_rows(num_rows, head_dim, fmt)
        return GpuStorage(rows, fmt, scales, packed=True)
    scales = DEVICE.empty((num_rows, fmt.scale_width(head_dim)), np.uint8) if fmt.blocked \
        else None
    return GpuStorage(DEVICE.empty((num_rows, fmt.row_width(head_dim)), fmt.raw), fmt, scales)


def pinned_rows(num_rows: int, head_dim: int, fmt: Format) -> Storage:
    """Unfilled page-locked rows; without a GPU ordinary host memory (nothing could read it
    over PCIe anyway)."""
    if gpu_available() and num_rows * head_dim > 0:
        return PinnedStorage(num_rows, head_dim, fmt)
    return host_rows(num_rows, head_dim, fmt)


def shared_rows(num_rows: int, head_dim: int, fmt: Format) -> Storage:
    """A node's segment is named by its rows: no unfilled one (an empty table is host rows)."""
    if num_rows * head_dim:
        raise ValueError("placement='shared' names its segment from the rows: pass the weight "
                         "(EmbeddingTable(weight, placement='shared')) or load a checkpoint "
                         "(load_ngram_embedding(..., placement='shared'))")
    return host_rows(num_rows, head_dim, fmt)


def adopt_host(side: Backend, array, fmt: Format) -> Storage | None:
    """A C-contiguous host array of a plain format, itself."""
    if not array.flags.c_contiguous or fmt.blocked or side is not HOST:
        return None
    return CpuStorage(array.view(fmt.dtype), fmt)


def adopt_device(side: Backend, array, fmt: Format) -> Storage | None:
    """A C-contiguous device array of a plain format, itself."""
    if not array.flags.c_contiguous or fmt.blocked or side is not DEVICE:
        return None
    if not gpu_available():
        raise ValueError(GPU_REFUSAL)
    return GpuStorage(array.view(fmt.raw), fmt)


def adopt_shared(side: Backend, array, fmt: Format) -> Storage | None:
    """The node's segment named by the rows' content hash (filled from ``array`` by the first
    process, attached by the others)."""
    if not (array.size or fmt.blocked):
        return None
    rows = array if side is HOST else array.get()
    raw = np.ascontiguousarray(rows).view(fmt.raw)

    def fill(destination: np.ndarray) -> None:
        destination[...] = raw

    return SharedStorage(content_key(raw, fmt), raw.shape[0], raw.shape[1], fmt, fill)


def adopt_none(side: Backend, array, fmt: Format) -> Storage | None:
    """Nothing adopted: the rows are always copied in."""
    return None


@dataclass(frozen=True)
class Placement:
    """One placement name, what a table placed there is, and how its storage is made.

    ``mapped``: served from a checkpoint's mapped files (only ``place`` with a source that maps
    them builds it); ``per_node``: one read-only segment per node, named by the rows.
    ``allocate(num_rows, head_dim, fmt)``: unfilled storage; ``adopt(side, array, fmt)``: a
    storage over the caller's array itself, or None where the rows must be copied.
    """

    name: str
    allocate: Callable[[int, int, Format], Storage] | None = None
    adopt: Callable[[Backend, Any, Format], Storage | None] = adopt_none
    mapped: bool = False
    per_node: bool = False
    serve: Callable[..., Storage] | None = None  # a mapped one's storage from a RowsSource

    @property
    def private(self) -> bool:
        """Whether the rows are in this process's own memory, which it may write and train."""
        return not (self.mapped or self.per_node)

    @property
    def fills(self) -> str:
        """The placement rows are filled in before they are placed: ``"cpu"`` for a per-node
        one (``place_filled`` then moves them into the node's segment), else itself."""
        return "cpu" if self.per_node else self.name

    def check_holds(self, fmt: Format, what: str | None = None) -> None:
        """A ValueError (prefixed by ``what``, e.g. the tensor) when the placement cannot hold
        ``fmt``'s rows: a node's segment holds one array, not block scales beside it."""
        if self.per_node and fmt.blocked:
            prefix = "" if what is None else f"{what}: "
            raise ValueError(prefix + block_scales_refusal(fmt))


def mapped_storage(source: RowsSource) -> Storage:
    """The rows served from the source's mapped files."""
    return MappedStorage(source.mapped(), source.head_dim, source.format, source.guard)


def disk_storage(source: RowsSource, cache_bytes: int = 0, cache_policy: str = DEFAULT_POLICY,
                 seed_rows=None) -> Storage:
    """The rows read from the source's files per lookup (``disk``), with a row cache of
    ``cache_bytes`` seeded with the local rows ``seed_rows``; a ValueError where the source
    cannot name its files."""
    if source.files is None:
        raise ValueError("placement='disk' reads a checkpoint's safetensors files: load the "
                         "table with load_ngram_embedding(..., placement='disk')")
    blocks, guard = source.files()
    storage = DiskStorage(blocks, source.head_dim, source.format, guard, cache_bytes,
                          cache_policy)
    if seed_rows is not None:
        storage.seed_cache(seed_rows)
    return storage


# Every placement, by name; "host" is the old name of "pinned" (page-locked host memory).
PLACEMENTS = {entry.name: entry for entry in (
    Placement("cpu", host_rows, adopt_host), Placement("gpu", device_rows, adopt_device),
    Placement("pinned", pinned_rows), Placement("shared", shared_rows, adopt_shared,
                                                per_node=True),
    Placement("mmap", mapped=True, serve=mapped_storage),
    Placement("disk", mapped=True, serve=disk_storage))}
ALIASES = {"host": "pinned"}
# Where a table goes unless told: this process's host memory (the torch module's default is
# "gpu" where there is one, ``torch.default_placement``; use_ngram_cupy's "pinned").
TABLE_PLACEMENT = "cpu"


def find_placement(placement) -> Placement | None:
    """The placement of a name (aliases resolved), or None for anything else."""
    if not isinstance(placement, str):
        return None
    return PLACEMENTS.get(ALIASES.get(placement, placement))


def placement_named(placement, *, mapped: bool = False) -> Placement:
    """The placement of a name (aliases resolved); ``mapped``: the rows come from a checkpoint
    that can map them, so ``"mmap"`` is one too. A ValueError naming the choices otherwise."""
    entry = find_placement(placement)
    if entry is not None and (mapped or not entry.mapped):
        return entry
    names = [name for name, known in PLACEMENTS.items() if mapped or not known.mapped]
    choices = ", ".join(repr(name) for name in (*names, *ALIASES))
    why = ("" if entry is None else
           f" ({entry.name!r} serves a checkpoint's rows from its mapped files: load the "
           f"checkpoint with placement={entry.name!r})")
    raise ValueError(f"placement must be one of {choices}, got {placement!r}{why}")


def canonical_placement(placement: str) -> str:
    """The name of a placement an in-memory weight can take, aliases resolved; a ValueError
    naming the choices otherwise."""
    return placement_named(placement).name


def allocate(placement: str, num_rows: int, head_dim: int, fmt: Format) -> Storage:
    """Unfilled storage of a placement (with its block scales for a block-scaled format, packed
    with the rows: one record per row, ``packed``)."""
    return placement_named(placement).allocate(num_rows, head_dim, fmt)


def adopt(placement: str, side: Backend, array, fmt: Format) -> Storage | None:
    """A storage over the caller's ``array`` itself (no copy) when the placement allows it:
    C-contiguous host arrays for ``"cpu"``, C-contiguous device arrays for ``"gpu"`` (block-scaled
    rows are always copied, with their scales). For ``"shared"``, the segment named by the rows'
    content hash (filled from ``array`` by the first process, attached by the others)."""
    return placement_named(placement).adopt(side, array, fmt)


@dataclass
class RowsSource:
    """Where a table's local rows ``[0, num_rows)`` of ``format`` come from, for ``place``.

    ``blocks()`` yields ``(first local row, rows, block scales or None)`` tiling them (NumPy, CuPy
    or torch arrays of the format's values or raw bits); it is called once, when the rows are
    copied. ``key`` names the rows for a node's segment (a checkpoint's files and row range), so
    that only the process that creates the segment reads them; None: the segment is named by
    their content, read into private memory first. ``mapped()`` gives the ``MappedStorage``
    blocks that serve the rows from mapped files (None: they cannot be mapped), checked by
    ``guard`` before every gather.
    """

    num_rows: int
    head_dim: int
    format: Format
    blocks: Callable[[], Iterable[tuple]]
    key: str | None = None
    mapped: Callable[[], Sequence[tuple]] | None = None
    guard: Callable[[], None] | None = None
    files: Callable[[], tuple[Sequence[DiskBlock], Callable[[], None]]] | None = None


def write_blocks(storage: Storage, blocks: Iterable[tuple]) -> None:
    """Copy ``(first local row, rows, block scales or None)`` blocks into ``storage``."""
    fmt = storage.format
    for start, rows, scales in blocks:
        call = bind(rows=rows, block_scales=scales)
        with call.on():
            storage.write_rows(start, call["rows"].view(fmt.raw),
                               None if scales is None else call["block_scales"].view(np.uint8))


def place(placement: str, source: RowsSource, **options) -> Storage:
    """The storage of ``placement`` holding the source's rows: its mapped files for ``"mmap"``
    (when it has them); the files read per lookup for ``"disk"`` (``options``: its
    ``cache_bytes`` and ``cache_policy``); for ``"shared"`` the node's segment of
    ``source.key`` (filled by the process that creates it, attached by the others) or, without
    a key, the rows filled privately and then moved into the segment of their content; else a
    new storage of the placement with the rows copied in block by block."""
    entry = placement_named(placement, mapped=source.mapped is not None)
    fmt, num_rows, head_dim = source.format, source.num_rows, source.head_dim
    entry.check_holds(fmt)
    if entry.mapped:
        return entry.serve(source, **options)
    if entry.per_node and source.key is not None and num_rows * head_dim:

        def fill(rows: np.ndarray) -> None:
            write_blocks(CpuStorage(rows.view(fmt.dtype), fmt), source.blocks())

        return SharedStorage(source.key, num_rows, head_dim, fmt, fill)
    filled = allocate(entry.fills, num_rows, head_dim, fmt)
    write_blocks(filled, source.blocks())
    placed = place_filled(entry.name, filled)
    if placed is not filled:
        filled.close()
    return placed


def place_filled(placement: str, filled: Storage) -> Storage:
    """The storage of ``placement`` over rows already filled into ``filled`` (a storage of
    ``Placement.fills``, e.g. loaded shard by shard): ``filled`` itself, or for ``"shared"``
    the node's segment named by the rows' content (then the caller closes ``filled``). The
    storage reports ``placement`` (pinned memory without a GPU is CPU storage)."""
    entry = placement_named(placement)
    placed = filled
    if entry.fills != entry.name:
        host = filled.host_view
        placed = adopt(entry.name, HOST, host, filled.format) or allocate(
            entry.name, host.shape[0], filled.head_dim, filled.format)
    placed.placement = entry.name
    return placed
