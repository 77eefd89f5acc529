"""Embedding tables: rows in CPU, GPU or pinned host memory, looked up with fused dequantisation.

``EmbeddingTable`` owns global rows ``[row_start, row_start + num_rows)`` of a table of
``total_rows`` rows (row sharding across ranks): other ids give zero rows and are never read.
NumPy ids are gathered on the CPU (Numba), CuPy / CUDA torch ids on the GPU (``kernels/gather.cu``),
which reads a ``"host"`` table over PCIe through its mapped address (UVA).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import gather_numba
from .arrays import DEVICE, HOST, convert, place
from .checks import check_destination, check_index_array, check_out
from .dequant import BFLOAT16, Format, default_output, output_format, storage_format
from .pinned import PinnedBuffer
from .prefetch import Buffers, Pending, StreamPrefetcher, ThreadPrefetcher

PLACEMENTS = ("cpu", "gpu", "host")
# Staging buffers (ids and rows) kept on the host: batch sizes vary from step to step.
HOST_BUFFER_SHAPES = 8
# Torch dtypes that NumPy and DLPack consumers cannot type: moved as same-width integers.
_TORCH_RAW = {"torch.bfloat16": "int16", "torch.float8_e4m3fn": "uint8"}


def _gpu_available() -> bool:
    """Whether CuPy is importable and sees a CUDA device."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def _unwrap(value: Any) -> tuple[Any, str | None]:
    """``(array, logical dtype name)``: torch bfloat16/float8 tensors become integer views."""
    name = str(getattr(value, "dtype", ""))
    if name in _TORCH_RAW and type(value).__module__.startswith("torch"):
        import torch

        return value.view(getattr(torch, _TORCH_RAW[name])), name
    return value, None


def _holds(array, fmt: Format) -> bool:
    """Whether ``array`` holds ``fmt`` values: of that dtype, or as same-width integer bits."""
    dtype = np.dtype(array.dtype)
    return dtype == fmt.dtype or (dtype.kind in "iu" and dtype.itemsize == fmt.itemsize)


def _empty(side: str):
    """``numpy.empty`` or ``cupy.empty``."""
    if side == HOST:
        return np.empty
    import cupy

    return cupy.empty


def staging_buffers(side: str) -> Buffers:
    """Buffers reused across calls: on the GPU all are kept (CUDA graphs hold their addresses),
    on the host the few most recent shapes."""
    return Buffers(_empty(side), keep=HOST_BUFFER_SHAPES if side == HOST else None)


def _address(array) -> int:
    """Data pointer of a NumPy or CuPy array."""
    return array.ctypes.data if isinstance(array, np.ndarray) else array.data.ptr


def _scale_value(scale) -> np.float32 | None:
    """The scale as a float32 scalar (exact for bf16 / f16 / f32 inputs), or None."""
    if scale is None:
        return None
    if hasattr(scale, "reshape"):
        count = scale.numel() if hasattr(scale, "numel") else scale.size
        if count != 1:
            raise ValueError(f"scale must be a single value, got shape {tuple(scale.shape)}")
        scale = scale.reshape(())
    try:
        value = np.float32(float(scale))
    except (TypeError, ValueError):
        raise TypeError(f"scale must be a number, got {type(scale).__name__}") from None
    if not np.isfinite(value):
        raise ValueError(f"scale must be finite, got {value}")
    return value


@dataclass
class _Request:
    """A checked lookup: which side, the ids, the output format and destination."""

    side: str
    ids: Any
    out_format: Format
    shape: tuple[int, int]
    out: Any  # public view of the caller's out, or None
    caller_out: Any  # the object the caller passed as out
    stream: Any


class EmbeddingTable:
    """``[num_rows, head_dim]`` rows (float32 / float16 / bfloat16 / float8 e4m3, optional scale)
    that turn ``ids[T, H]`` into ``[T, H * head_dim]`` dequantised vectors.

    ``placement``: ``"cpu"`` (NumPy, Numba gather), ``"gpu"`` (device memory) or ``"host"``
    (page-locked host memory of exactly the table's size, read by the GPU over PCIe; without a
    GPU, ordinary memory and the CPU gather). ``dtype`` names the storage type of raw-bit weights
    (CuPy has no bfloat16 / float8). ``dedup=True`` makes GPU lookups fetch each distinct id once
    (worth it for large batches over PCIe; it waits for the GPU, so it is not graph-capturable).
    """

    def __init__(self, weight, scale=None, placement: str = "cpu", row_start: int = 0,
                 total_rows: int | None = None, *, dtype=None, dedup: bool = False):
        weight, torch_dtype = _unwrap(weight)
        side, arrays = convert(weight=weight)
        weight = arrays["weight"]
        if weight.ndim != 2:
            raise ValueError(f"weight must be 2-D [rows, head_dim], got shape {weight.shape}")
        if dtype is None:
            dtype = torch_dtype or weight.dtype
        fmt = storage_format(dtype, "dtype" if torch_dtype is None else "weight")
        if not _holds(weight, fmt):
            raise TypeError(f"weight of dtype {weight.dtype} cannot hold {fmt.name} values")
        self._setup(weight.shape[0], weight.shape[1], fmt, placement, scale, row_start,
                    total_rows, dedup, storage=weight, storage_side=side)

    @classmethod
    def empty(cls, num_rows: int, head_dim: int, dtype, placement: str = "cpu", scale=None,
              row_start: int = 0, total_rows: int | None = None, *,
              dedup: bool = False) -> EmbeddingTable:
        """Allocated, unfilled storage, to be filled with ``write_rows`` (checkpoint loading)."""
        table = cls.__new__(cls)
        table._setup(num_rows, head_dim, storage_format(dtype), placement, scale, row_start,
                     total_rows, dedup)
        return table

    # ---- construction ----

    def _setup(self, num_rows, head_dim, fmt, placement, scale, row_start, total_rows, dedup,
               storage=None, storage_side=None):
        """Check the geometry, allocate (or adopt) the storage, and fill it from ``storage``."""
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
        total_rows = num_rows if total_rows is None else total_rows
        for name, value in (("num_rows", num_rows), ("head_dim", head_dim),
                            ("row_start", row_start), ("total_rows", total_rows)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"{name} must be an integer, got {value!r}")
        num_rows, head_dim, row_start, total_rows = map(int, (num_rows, head_dim, row_start,
                                                              total_rows))
        if min(num_rows, head_dim) < 0:
            raise ValueError(f"num_rows and head_dim must be non-negative, got {num_rows} and "
                             f"{head_dim}")
        if not 0 <= row_start <= row_start + num_rows <= total_rows:
            raise ValueError(
                f"rows [{row_start}, {row_start + num_rows}) must lie within [0, total_rows="
                f"{total_rows})")
        self.num_rows, self.head_dim, self.format = num_rows, head_dim, fmt
        self.dtype = fmt.dtype
        self.scale = _scale_value(scale)
        self.placement = placement
        self.row_start, self.total_rows = row_start, total_rows
        self.nbytes = num_rows * head_dim * fmt.itemsize
        self.dedup = bool(dedup)
        self.pinned = False
        self.host_view: np.ndarray | None = None
        self._device_rows = None  # raw CuPy view the GPU gathers from
        self._pinned: PinnedBuffer | None = None
        self._threads = ThreadPrefetcher()
        self._stream: StreamPrefetcher | None = None
        self._buffers: dict[str, Buffers] = {}
        adopted = self._allocate(storage, storage_side)
        weakref.finalize(self, EmbeddingTable._release, self._threads, self._pinned, False)
        if storage is not None and not adopted:
            self._copy_in(0, storage)

    def _allocate(self, storage, storage_side) -> bool:
        """Set up the storage of the placement; True when the caller's array is used as it is."""
        shape, fmt = (self.num_rows, self.head_dim), self.format
        if self.placement == "gpu":
            if not _gpu_available():
                raise RuntimeError("placement='gpu' needs CuPy and a CUDA device")
            if storage_side == DEVICE and storage.flags.c_contiguous:
                self._device_rows = storage.view(fmt.raw)
                return True
            self._device_rows = _empty(DEVICE)(shape, dtype=fmt.raw)
        elif self.placement == "host" and _gpu_available() and self.nbytes > 0:
            self._pinned = PinnedBuffer(self.nbytes)
            self.pinned = True
            self.host_view = self._pinned.array.view(fmt.dtype).reshape(shape)
            self._device_rows = self._pinned.device_array(shape, fmt.raw)
        elif storage_side == HOST and self.placement == "cpu" and storage.flags.c_contiguous:
            self.host_view = storage.view(fmt.dtype)
            return True
        else:
            self.host_view = np.empty(shape, dtype=fmt.dtype)
        return False

    def _copy_in(self, local_start: int, rows) -> None:
        """Copy a NumPy or CuPy block of rows into local rows ``[local_start, +len(rows))``."""
        stop = local_start + rows.shape[0]
        raw = rows.view(self.format.raw)
        if self.host_view is not None:
            block = raw if isinstance(raw, np.ndarray) else raw.get()
            self.host_view.view(self.format.raw)[local_start:stop] = block
        elif isinstance(raw, np.ndarray):
            self._device_rows[local_start:stop].set(np.ascontiguousarray(raw))
        else:
            self._device_rows[local_start:stop] = raw

    def write_rows(self, start: int, rows) -> None:
        """Copy a block of rows into global rows ``[start, start + len(rows))``, in place.

        The block must lie inside the owned rows and match ``head_dim`` and ``dtype``. Host
        placements write straight into their memory; ``"gpu"`` copies just this block over.
        """
        rows, torch_dtype = _unwrap(rows)
        _, arrays = convert(rows=rows)
        rows = arrays["rows"]
        if rows.ndim != 2 or rows.shape[1] != self.head_dim:
            raise ValueError(f"rows must have shape [n, head_dim={self.head_dim}], got "
                             f"{tuple(rows.shape)}")
        if not (_holds(rows, self.format) if torch_dtype is None
                else storage_format(torch_dtype, "rows") == self.format):
            raise TypeError(f"rows must have dtype {self.format.name}, got "
                            f"{torch_dtype or rows.dtype}")
        if isinstance(start, bool) or not isinstance(start, (int, np.integer)):
            raise TypeError(f"start must be an integer, got {type(start).__name__}")
        end = start + rows.shape[0]
        if start < self.row_start or end > self.row_start + self.num_rows:
            raise ValueError(
                f"rows [{start}, {end}) fall outside this table's rows [{self.row_start}, "
                f"{self.row_start + self.num_rows})")
        if self.host_view is not None and not self.host_view.flags.writeable:
            raise ValueError("the table's storage is read-only")
        self._copy_in(start - self.row_start, rows)

    @property
    def device_rows(self):
        """The raw-bit ``[num_rows, head_dim]`` CuPy view GPU kernels read (device memory, or
        pinned host memory through its mapped address); None when the GPU cannot read the table."""
        return self._device_rows

    # ---- lookups ----

    def _request(self, ids, out, out_dtype, stream) -> _Request:
        """Check and convert one lookup's arguments; errors name the argument."""
        check_destination("out", out)
        caller_out = out
        out, out_torch_dtype = _unwrap(out)
        stream, arrays = place(stream, ids=ids, out=out)
        side = HOST if stream is None else DEVICE
        ids = arrays["ids"]
        check_index_array("ids", ids, 2)
        self._check_side(side)
        if side == HOST:
            ids = np.ascontiguousarray(ids)
        else:
            import cupy

            with stream:
                ids = cupy.ascontiguousarray(ids)
        out_format, out = self.destination(side, ids.shape, arrays["out"], out_dtype,
                                           out_torch_dtype)
        shape = (ids.shape[0], ids.shape[1] * self.head_dim)
        return _Request(side, ids, out_format, shape, out, caller_out, stream)

    def _check_side(self, side: str) -> None:
        """Refuse ids on a side that cannot read this table."""
        if side == HOST and self.host_view is None:
            raise ValueError("this table is in GPU memory: pass ids on the GPU (CuPy or CUDA "
                             "torch)")
        if side == DEVICE and self._device_rows is None:
            raise ValueError(f"this table (placement={self.placement!r}) is not readable by the "
                             "GPU: pass NumPy / CPU ids, or place it on 'gpu' or 'host'")

    def destination(self, side: str, ids_shape: tuple[int, int], out, out_dtype,
                    out_torch_dtype: str | None = None) -> tuple[Format, Any]:
        """The output format of a lookup of ``ids_shape`` ids, and ``out`` checked and viewed
        as that format's array type (None stays None)."""
        self._check_side(side)
        if out_dtype is not None:
            out_format = output_format(out_dtype)
        elif out is not None and (out_torch_dtype or out.dtype.kind not in "iu"):
            out_format = output_format(out_torch_dtype or out.dtype, "out")
        else:
            out_format = default_output(self.format)
        if out is not None:
            public = self.public_dtype(side, out_format)
            if _holds(out, out_format):
                out = out.view(public)
            check_out("out", out, (ids_shape[0], ids_shape[1] * self.head_dim), public)
        return out_format, out

    @staticmethod
    def public_dtype(side: str, fmt: Format):
        """Output dtype: the real one on the host; raw uint16 for bfloat16 on the GPU (no CuPy
        bfloat16: ``torch.from_dlpack(out).view(torch.bfloat16)`` reads it)."""
        return fmt.raw if side == DEVICE and fmt.code == BFLOAT16 else fmt.dtype

    def _buffers_for(self, side: str) -> Buffers:
        """Staging buffers of one side, allocated once per shape."""
        if side not in self._buffers:
            self._buffers[side] = staging_buffers(side)
        return self._buffers[side]

    def _gather(self, request: _Request, ids, out, expected=None, worker: bool = False):
        """Gather ``ids`` into the public array ``out`` on the request's side."""
        scale = np.float32(1.0) if self.scale is None else self.scale
        raw_out = out.view(request.out_format.raw)
        if request.side == HOST:  # the worker gathers serially: two threads running Numba
            # parallel kernels at once abort the process under the workqueue threading layer
            gather_numba.gather_rows(self.host_view.view(self.format.raw), self.format.code,
                                     self.row_start, scale, ids, raw_out,
                                     request.out_format.code, expected,
                                     parallel=False if worker else None)
            return
        from . import gather_cupy

        if self.dedup and expected is None:
            gather_cupy.gather_unique_rows(self._device_rows, self.format.code, self.row_start,
                                           scale, ids, raw_out, request.out_format.code)
        else:
            gather_cupy.gather_rows(self._device_rows, self.format.code, self.row_start, scale,
                                    ids, raw_out, request.out_format.code, expected)

    def _join(self, request: _Request) -> Pending | None:
        """Join the issued prefetch of this side, if any (it owns the staging buffers)."""
        if request.side == HOST:
            return self._threads.join()
        return None if self._stream is None else self._stream.join(request.stream)

    def lookup(self, ids, out=None, out_dtype=None, stream=None):
        """Rows of ``ids[T, H]`` as ``[T, H * head_dim]``: heads in order, dequantised.

        ``float(value) * scale`` is computed in float32 and rounded once (to nearest even) to
        ``out_dtype``: by default float32 for float32 tables, float16 for float16 tables and
        bfloat16 for bfloat16 and float8 ones (or the dtype of ``out``). NumPy ids give a NumPy
        array; CuPy / CUDA torch ids a CuPy array (bfloat16 as raw uint16 bits), computed on
        ``stream`` (CuPy's current one by default) without a host sync. After a ``prefetch``
        of the same shape, the result lives in the prefetch's buffer (or is copied to ``out``)
        and only the heads whose ids changed are gathered again; that buffer is reused by the
        next prefetch of the same shape.
        """
        request = self._request(ids, out, out_dtype, stream)
        with self._on(request):
            pending = self._join(request)
            if (pending is not None and pending.ids.shape == request.ids.shape
                    and pending.out_code == request.out_format.code):
                target = pending.rows if request.out is None else request.out
                if _address(target) != _address(pending.rows):
                    target[...] = pending.rows
                self._gather(request, request.ids, target, expected=pending.ids)
            else:
                target = request.out
                if target is None:
                    target = _empty(request.side)(
                        request.shape, dtype=self.public_dtype(request.side, request.out_format))
                self._gather(request, request.ids, target)
        return target if request.out is None else request.caller_out

    def prefetch(self, ids, out=None, out_dtype=None, stream=None) -> None:
        """Start gathering ``ids`` now, so that the next ``lookup`` of them finds them ready.

        On the GPU the gather runs on a private stream once ``stream`` (the caller's) reaches
        this point; on the CPU, on a worker thread. ``ids`` may change afterwards: a copy is
        gathered. Rows go to ``out`` when given (pass the same ``out`` to ``lookup``), else to a
        staging buffer allocated once per shape. Errors in the worker surface at the next
        ``lookup`` or ``prefetch``.
        """
        request = self._request(ids, out, out_dtype, stream)
        buffers = self._buffers_for(request.side)
        with self._on(request):
            self._join(request)  # the previous prefetch owns the snapshot and staging buffers
            snapshot = buffers.get("ids", request.ids.shape, np.int64)
            snapshot[...] = request.ids
            rows = request.out
            if rows is None:
                rows = buffers.get("rows", request.shape,
                                   self.public_dtype(request.side, request.out_format))
            pending = Pending(snapshot, rows, request.out_format.code)
            if request.side == HOST:
                self._threads.start(pending, lambda: self._gather(request, snapshot, rows,
                                                                  worker=True))
            else:
                if self._stream is None:
                    self._stream = StreamPrefetcher()
                self._stream.start(request.stream, pending,
                                   lambda: self._gather(request, snapshot, rows))

    @staticmethod
    def _on(request: _Request):
        """The caller's CUDA stream as the current one (GPU), or nothing (CPU)."""
        return request.stream if request.side == DEVICE else contextlib.nullcontext()

    # ---- lifetime ----

    @staticmethod
    def _release(threads: ThreadPrefetcher, pinned: PinnedBuffer | None, wait: bool) -> None:
        """Stop the worker and unregister pinned memory (also run at garbage collection, which
        must not wait for the worker thread)."""
        threads.close(wait)
        if pinned is not None:
            pinned.close()

    def close(self) -> None:
        """Finish any prefetch and release the pinned registration; the table is then unusable
        on the GPU."""
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        EmbeddingTable._release(self._threads, self._pinned, True)
        if self._pinned is not None:
            self._device_rows = None

    def __enter__(self) -> EmbeddingTable:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        scale = "" if self.scale is None else f", scale={float(self.scale)}"
        return (f"EmbeddingTable(rows=[{self.row_start}, {self.row_start + self.num_rows}) of "
                f"{self.total_rows}, head_dim={self.head_dim}, dtype={self.format.name}{scale}, "
                f"placement={self.placement!r}{', pinned' if self.pinned else ''})")

