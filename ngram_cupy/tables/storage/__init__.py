"""Table storage: one class per placement, all with the same small interface.

A storage holds a table's local rows ``[0, num_rows)`` as the bits of one format (``format``),
in one kind of memory. ``EmbeddingTable`` is a thin front over a storage: it checks arguments,
owns the global geometry (``row_start``, ``total_rows``), the scale and the prefetch protocol, and
asks the storage for everything that depends on where the rows live.

The interface (``Storage`` in ``base``; each placement is one module: ``cpu``, ``gpu``,
``pinned``, ``shared``, ``mapped``, ``tiered``):

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
  (block-scaled formats; else None): every placement carries them with the rows.
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

A new placement is one more class: a tiered storage (hot rows in GPU memory over a cold storage)
implements the same methods, gathering hot rows itself and the rest through the cold storage,
and ``EmbeddingTable(storage, scale, row_start=..., total_rows=...)`` takes it as it is.
``allocate`` makes the storage of a placement name; ``adopt`` wraps a caller's array when it can
serve as the storage without a copy.
"""

from __future__ import annotations

import numpy as np

from ...formats import Format
from ...runtime.backends import DEVICE, HOST, Backend, gpu_available
from ..host_memory import anonymous_memory
from ..packed import packed_rows
from .base import Gather, Storage
from .cpu import CpuStorage
from .gpu import GpuStorage
from .pinned import PinnedStorage
from .shared import SharedStorage, content_key

__all__ = ["Gather", "Storage", "adopt", "allocate", "canonical_placement"]

# Placement names; "host" is the old name of "pinned" (page-locked host memory).
PLACEMENTS = ("cpu", "gpu", "pinned", "shared")
ALIASES = {"host": "pinned"}


def canonical_placement(placement: str) -> str:
    """The placement name, aliases resolved; a ValueError naming the choices otherwise."""
    placement = ALIASES.get(placement, placement) if isinstance(placement, str) else placement
    if placement not in PLACEMENTS:
        choices = ", ".join(repr(p) for p in (*PLACEMENTS, *ALIASES))
        raise ValueError(f"placement must be one of {choices}, got {placement!r}")
    return placement


def allocate(placement: str, num_rows: int, head_dim: int, fmt: Format) -> Storage:
    """Unfilled storage of a placement (with its block scales for a block-scaled format: in
    host memory, packed with the rows, one record per row).
    ``"pinned"`` without a GPU is ordinary host memory (nothing could read it over PCIe
    anyway)."""
    placement = canonical_placement(placement)
    shape = (num_rows, fmt.row_width(head_dim))
    scale_shape = (num_rows, fmt.scale_width(head_dim))
    if placement == "gpu":
        if not gpu_available():
            raise RuntimeError("placement='gpu' needs CuPy and a CUDA device")
        scales = DEVICE.empty(scale_shape, np.uint8) if fmt.blocked else None
        return GpuStorage(DEVICE.empty(shape, fmt.raw), fmt, scales)
    if placement == "shared" and num_rows * head_dim:
        raise ValueError("placement='shared' names its segment from the rows: pass the weight "
                         "(EmbeddingTable(weight, placement='shared')) or load a checkpoint "
                         "(load_ngram_embedding(..., placement='shared'))")
    if placement == "pinned" and gpu_available() and num_rows * head_dim > 0:
        return PinnedStorage(num_rows, head_dim, fmt)
    if fmt.blocked and num_rows * head_dim > 0:  # one record per row (``packed``)
        records, rows, scales = packed_rows(num_rows, head_dim, fmt)
        return CpuStorage(rows, fmt, scales, records)
    scales = np.empty(scale_shape, np.uint8) if fmt.blocked else None
    if num_rows * head_dim == 0:
        return CpuStorage(np.empty(shape, fmt.dtype), fmt, scales)
    memory = anonymous_memory(shape[0] * shape[1] * fmt.itemsize)  # huge pages where offered
    return CpuStorage(np.frombuffer(memory, fmt.dtype).reshape(shape), fmt, scales)


def adopt(placement: str, side: Backend, array, fmt: Format) -> Storage | None:
    """A storage over the caller's ``array`` itself (no copy) when the placement allows it:
    C-contiguous host arrays for ``"cpu"``, C-contiguous device arrays for ``"gpu"`` (block-scaled
    rows are always copied, with their scales). For ``"shared"``, the segment named by the rows'
    content hash (filled from ``array`` by the first process, attached by the others)."""
    placement = canonical_placement(placement)
    if placement == "shared" and (array.size or fmt.blocked):
        rows = array if side is HOST else array.get()
        raw = np.ascontiguousarray(rows).view(fmt.raw)

        def fill(destination: np.ndarray) -> None:
            destination[...] = raw

        return SharedStorage(content_key(raw, fmt), raw.shape[0], raw.shape[1], fmt, fill)
    if not array.flags.c_contiguous or fmt.blocked:
        return None
    if placement == "cpu" and side is HOST:
        return CpuStorage(array.view(fmt.dtype), fmt)
    if placement == "gpu" and side is DEVICE:
        if not gpu_available():
            raise RuntimeError("placement='gpu' needs CuPy and a CUDA device")
        return GpuStorage(array.view(fmt.raw), fmt)
    return None
