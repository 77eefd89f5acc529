"""Embedding tables: a storage, a format and a prefetcher behind one lookup front.

``EmbeddingTable`` owns global rows ``[row_start, row_start + num_rows)`` of a table of
``total_rows`` rows (row sharding across ranks): other ids give zero rows and are never read.
Where the rows live is its storage (``storage/``: CPU, GPU, pinned host memory, mapped files);
what they hold is its format (``formats.py``); ``prefetch.py`` runs gathers ahead of lookups.
NumPy ids are gathered on the CPU (Numba), CuPy / CUDA torch ids on the GPU
(``kernels/gather.cu``), which reads a pinned table over PCIe through its mapped address (UVA).
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import numpy as np

from ..codecs.dequant import check_scale_rounding, rounded_scale
from ..codecs.quantize import QuantizedTable
from ..codecs.scales import block_scale_bits, table_scale
from ..formats import (
    Format,
    bits_name,
    default_output,
    holds,
    output_format,
    storage_format,
)
from ..runtime.backends import DEVICE, HOST, Backend, bind, cuda_stream
from ..runtime.checks import (
    check_apart,
    check_geometry,
    check_integer,
    check_out,
)
from .bad_ids import BadIds
from .hot_rows import check_hot_rows
from .lookup_request import LookupRequest
from .prefetch import Prefetcher
from .storage import (
    TABLE_PLACEMENT,
    Gather,
    Storage,
    adopt,
    allocate,
    canonical_placement,
    placement_list,
)
from .storage.tiered import TieredStorage
from .writers import Writers, regather_written


def public_dtype(side: Backend, fmt: Format):
    """Output dtype: the real one on the host; raw uint16 for bfloat16 on the GPU (no CuPy
    bfloat16: ``torch.from_dlpack(out).view(torch.bfloat16)`` reads it)."""
    return fmt.raw if side is DEVICE and bits_name(fmt) else fmt.dtype


class EmbeddingTable:
    """``[num_rows, head_dim]`` rows in one of six formats (float32, float16, bfloat16,
    float8_e4m3fn with an optional scalar scale, block-scaled NVFP4 and MXFP8) that turn
    ``ids[T, H]`` into ``[T, H * head_dim]`` dequantised vectors.

    Args:
        weight: the rows, ``[rows, head_dim]`` (NVFP4: uint8 ``[rows, head_dim / 2]``, two E2M1
            codes a byte, low nibble first): a NumPy, CuPy or torch array, anything exporting
            DLPack, a ``tables.storage.Storage``, or a ``QuantizedTable`` (``quantize_table``'s
            result, which brings its scale and block scales).
        scale: a finite scalar multiplied into every value, or None (default). float8: the
            checkpoint's ``weight_scale`` (any float type); NVFP4: the float32 global scale
            (``weight_scale_2``); refused for MXFP8, whose block scales are its only ones.
        placement: ``"cpu"`` (default; NumPy, gathered by Numba on all cores), ``"gpu"``
            (device memory), ``"pinned"`` or its alias ``"host"`` (page-locked host memory of
            exactly the table's size, read by the GPU over PCIe; without a GPU, ordinary memory
            and the CPU gather), or ``"shared"`` (as ``"pinned"``, in one read-only
            shared-memory segment per node named by the rows' content).
        row_start: the first global row this table holds (row sharding; default 0).
        total_rows: the global row count (default ``row_start + rows``); ids outside
            ``[row_start, row_start + rows)`` give zero rows and are never read.
        dtype: the storage format by name or dtype, for raw-bit weights (CuPy has no bfloat16
            or float8) and for ``"nvfp4"`` / ``"mxfp8"``; default None: the weight's own dtype.
        dedup: GPU lookups fetch each distinct id once (default False; pays for large batches
            over PCIe, waits for the GPU, so not graph-capturable).
        hot_rows: sorted unique int64 global row ids (e.g. ``ngram-cupy stats
            --save-hot-rows``) copied into a hot tier (GPU memory for a pinned table on a GPU,
            else host memory) that lookups read them from in the same launch; ``counters`` then
            counts the rows read from each tier. Default None: no tier.
        scale_rounding: ``"output"`` (default; vLLM 0.33's dequantisation: the scale rounded to
            the output dtype, then the product) or ``"float32"`` (the float32 product rounded
            once). Block-scaled formats always round once.
        block_scales: NVFP4 (E4M3, one per 16 values) or MXFP8 (UE8M0, one per 32 values)
            scales, ``[rows, head_dim / block]``, as their dtype or uint8 bits; required for
            those formats, refused for the others.

    Returns:
        The table; ``lookup(ids, out=None, out_dtype=None)`` gives float32 for float32 rows,
        float16 for float16, bfloat16 for the others (``out_dtype`` picks another of the three).

    Raises:
        ValueError / TypeError naming the argument (wrong shape, unknown dtype or placement,
        a scale or block scales the format does not take).
    """

    def __init__(self, weight, scale=None, placement: str = TABLE_PLACEMENT, row_start: int = 0,
                 total_rows: int | None = None, *, dtype=None, dedup: bool = False,
                 hot_rows=None, scale_rounding: str = "output", block_scales=None):
        check_scale_rounding(scale_rounding)
        if isinstance(weight, QuantizedTable):  # its rows, scale, format and block scales
            if scale is not None or dtype is not None or block_scales is not None:
                raise ValueError("a QuantizedTable brings its own scale, dtype and block_scales")
            weight, scale, dtype, block_scales = weight.table_arguments().values()
        if isinstance(weight, Storage):
            if block_scales is not None:
                raise ValueError("block_scales come with the storage's rows, not beside them")
            storage = self._tiered(weight, hot_rows, row_start)
            self._setup(storage, weight.placement, scale, row_start, total_rows, dedup,
                        scale_rounding)
            return
        call = bind(weight=weight, block_scales=block_scales)
        array, torch_format = call["weight"], call.formats.get("weight")
        if array.ndim != 2:
            raise ValueError(f"weight must be 2-D [rows, head_dim], got shape {array.shape}")
        fmt = storage_format(dtype or torch_format or array.dtype,
                             "dtype" if torch_format is None else "weight")
        if not holds(array.dtype, fmt):
            raise TypeError(f"weight of dtype {array.dtype} cannot hold {fmt.name} values")
        head_dim = array.shape[1] * fmt.pack
        fmt.check_head_dim(head_dim, "weight.shape[1] * 2" if fmt.pack == 2 else "weight")
        scales = block_scale_bits(fmt, call["block_scales"], call.formats.get("block_scales"),
                                  array.shape[0], head_dim)
        table_scale(fmt, scale)  # checked before anything is allocated
        placement = canonical_placement(placement)
        check_geometry(array.shape[0], head_dim, row_start, total_rows)
        storage = adopt(placement, call.side, array, fmt)
        if storage is None:
            storage = allocate(placement, array.shape[0], head_dim, fmt)
            with call.on():
                storage.write_rows(0, array.view(fmt.raw), scales)
        self._setup(self._tiered(storage, hot_rows, row_start), placement, scale, row_start,
                    total_rows, dedup, scale_rounding)

    @classmethod
    def empty(cls, num_rows: int, head_dim: int, dtype, placement: str = TABLE_PLACEMENT,
              scale=None, row_start: int = 0, total_rows: int | None = None, *,
              dedup: bool = False, hot_rows=None,
              scale_rounding: str = "output") -> EmbeddingTable:
        """Allocated, unfilled storage, to be filled with ``write_rows`` (checkpoint loading)."""
        check_scale_rounding(scale_rounding)
        fmt = storage_format(dtype)
        placement = canonical_placement(placement)
        check_geometry(num_rows, head_dim, row_start, total_rows)
        fmt.check_head_dim(head_dim)
        table_scale(fmt, scale)
        return cls(allocate(placement, int(num_rows), int(head_dim), fmt), scale,
                   row_start=row_start, total_rows=total_rows, dedup=dedup,
                   hot_rows=hot_rows, scale_rounding=scale_rounding)._named(placement)

    # ---- construction ----

    @staticmethod
    def _tiered(storage: Storage, hot_rows, row_start) -> Storage:
        """``storage`` itself, or a tier of checked ``hot_rows`` over it."""
        if hot_rows is None:
            return storage
        check_integer("row_start", row_start)
        hot = check_hot_rows(hot_rows, int(row_start), storage.num_rows)
        return TieredStorage(storage, hot - int(row_start))

    def _setup(self, storage: Storage, placement: str, scale, row_start, total_rows,
               dedup: bool, scale_rounding: str) -> None:
        """Adopt ``storage`` with the global geometry, scale and a prefetcher."""
        check_geometry(storage.num_rows, storage.head_dim, row_start, total_rows)
        self.storage = storage
        self.num_rows, self.head_dim, self.format = storage.num_rows, storage.head_dim, \
            storage.format
        self.dtype = self.format.dtype
        self.scale = table_scale(storage.format, scale)
        self.scale_rounding = scale_rounding
        self.placement = placement
        self.row_start = int(row_start)
        self.total_rows = self.num_rows if total_rows is None else int(total_rows)
        self.nbytes = self.num_rows * self.format.row_bytes(self.head_dim)
        self.dedup = bool(dedup)
        self.prefetcher = Prefetcher()
        self.bad_ids = BadIds()  # ids outside the table met by GPU lookups, raised later
        self.writers = Writers()  # row updates: asynchronous optimizers, writes since a prefetch
        self.closed = False
        weakref.finalize(self, self.prefetcher.close, False)  # never joins the worker

    def _named(self, placement: str) -> EmbeddingTable:
        """Report the placement asked for (a pinned table without a GPU is CPU storage)."""
        self.placement = placement
        return self

    @property
    def scale(self) -> np.float32 | None:
        """The float32 scale every value is multiplied by, or None."""
        return self._scale

    @scale.setter
    def scale(self, value) -> None:
        """Set the scale: finite and positive, as constructors check (others give wrong rows)."""
        self._scale = table_scale(self.format, value)

    @property
    def pinned(self) -> bool:
        """Whether the rows (a hot tier's cold ones) are in page-locked memory the GPU reads."""
        return self.storage.cold.page_locked

    @property
    def counters(self) -> dict[str, int]:
        """Rows read from each tier since creation, ``{"hot_rows": .., "cold_rows": ..}``, for a
        table with ``hot_rows`` (reading the GPU's counts waits for the streams that looked the
        table up, and refuses while one of them captures a CUDA graph); else empty."""
        return self.storage.counters

    def cache_stats(self) -> dict:
        """A disk table's row cache counters per tier and overall (docs/disk.md); else empty."""
        return self.storage.cache_stats()

    def wait_for_updates(self) -> None:
        """Wait until every row update issued so far (asynchronous optimizers) is applied,
        raising once an error a pending one raised: every reader of the rows calls it first."""
        self.writers.wait()

    @property
    def host_view(self) -> np.ndarray | None:
        """The rows in host memory (of the storage dtype), or None when they are not there; read
        after the pending updates (``wait_for_updates``), as are the views below."""
        self.wait_for_updates()
        return self.storage.host_view

    @property
    def host_scales(self) -> np.ndarray | None:
        """The block scales (uint8 ``[num_rows, head_dim / block]``) beside ``host_view``, for a
        block-scaled table in host memory; else None."""
        self.wait_for_updates()
        return self.storage.host_scales

    @property
    def device_rows(self):
        """The raw-bit ``[num_rows, head_dim]`` CuPy view GPU kernels read (device memory, or
        pinned host memory through its mapped address); None when the GPU cannot read the table."""
        self.wait_for_updates()
        return self.storage.device_view

    def device_rows_on(self, stream):
        """``(rows, tier)`` for a kernel outside the table (the fused ids + gather) that reads it
        on ``stream``: the raw ``device_rows`` (the cold rows of a tiered table) and the hot tier
        over them (``TieredStorage.device_tier``), or None for an untiered table; ``(None,
        None)`` when the GPU cannot read the table. The storage keeps its memory until that
        stream's work is done."""
        self.wait_for_updates()
        storage = self.storage
        rows = storage.cold.device_view
        if rows is None:
            return None, None
        storage.used_on(stream)
        return rows, storage.device_tier

    @property
    def device_scales(self):
        """The block scales beside ``device_rows`` (the cold rows' of a tiered table), uint8
        ``[num_rows, head_dim / block]`` on the GPU; None for other formats or off the GPU."""
        self.wait_for_updates()
        return self.storage.cold.device_scales

    def write_rows(self, start: int, rows, block_scales=None) -> None:
        """Copy a block of rows into global rows ``[start, start + len(rows))``, in place.

        The block must lie inside the owned rows and match ``head_dim`` and ``dtype`` (a
        block-scaled table's packed ``[n, head_dim / 2]`` bytes come with their
        ``block_scales``). Host placements write straight into their memory; ``"gpu"`` copies
        just this block over. GPU lookups still running (on any stream) finish first, so none
        reads a half-written row; during a CUDA graph capture of a lookup this is a RuntimeError.
        When this returns, every later lookup sees the rows, on any stream or graph replay.
        """
        call = bind(rows=rows, block_scales=block_scales)
        rows, torch_format = call["rows"], call.formats.get("rows")
        width = self.format.row_width(self.head_dim)
        if rows.ndim != 2 or rows.shape[1] != width:
            shown = f"head_dim / {self.format.pack}" if self.format.pack > 1 else "head_dim"
            raise ValueError(f"rows must have shape [n, {shown}={width}], got "
                             f"{tuple(rows.shape)}")
        scales = block_scale_bits(self.format, call["block_scales"],
                                  call.formats.get("block_scales"), rows.shape[0], self.head_dim)
        if not (holds(rows.dtype, self.format) if torch_format is None
                else torch_format.dtype == self.format.dtype):  # MXFP8 rows are float8
            shown = rows.dtype if torch_format is None else f"torch.{torch_format.torch_name}"
            raise TypeError(f"rows must have dtype {self.format.name}, got {shown}")
        check_integer("start", start)
        end = start + rows.shape[0]
        if start < self.row_start or end > self.row_start + self.num_rows:
            raise ValueError(
                f"rows [{start}, {end}) fall outside this table's rows [{self.row_start}, "
                f"{self.row_start + self.num_rows})")
        if not self.storage.writable:
            raise ValueError("the table's storage is read-only")
        self.wait_for_updates()
        self.storage.wait_for_readers("write rows")
        with call.on():
            self.storage.write_rows(int(start) - self.row_start, rows.view(self.format.raw),
                                    scales)
        self.writers.wrote((int(start), end))  # a pending prefetch gathers these again

    def refresh_hot_rows(self) -> None:
        """Copy the hot tier's rows again from the table's rows (nothing without ``hot_rows``).

        ``write_rows`` keeps the tier current; rows changed any other way (in place through
        ``host_view``, or a torch tensor sharing it) leave stale hot copies until this is called.
        """
        self.storage.refresh_hot_rows()  # after the lookups still reading, as write_rows

    # ---- lookups ----

    def check_side(self, side: Backend) -> None:
        """Refuse ids on a side that cannot read this table."""
        if self.storage.reads(side):
            return
        if self.storage.refusal(side) is not None:
            raise ValueError(self.storage.refusal(side))
        if side is HOST:
            raise ValueError("this table is in GPU memory: pass ids on the GPU (CuPy or CUDA "
                             "torch)")
        raise ValueError(f"this table (placement={self.placement!r}) is not readable by the "
                         "GPU: pass NumPy / CPU ids, or place it on "
                         + placement_list("gpu", "pinned"))

    def destination(self, side: Backend, ids_shape: tuple[int, int], out, out_dtype,
                    out_format: Format | None = None) -> tuple[Format, Any]:
        """The output format of a lookup of ``ids_shape`` ids, and ``out`` checked and viewed
        as that format's array type (None stays None). ``out_format``: the format of a torch
        ``out`` passed as its bits."""
        self.check_side(side)
        if out_dtype is not None:
            fmt = output_format(out_dtype)
        elif out is not None and (out_format is not None or out.dtype.kind not in "iu"):
            fmt = out_format if out_format is not None else output_format(out.dtype, "out")
            if not fmt.output:
                raise TypeError(f"out must be float32, float16 or bfloat16, got {fmt.name}")
        else:
            fmt = default_output(self.format)
        if out is not None:
            public = public_dtype(side, fmt)
            if holds(out.dtype, fmt):
                out = out.view(public)
            check_out("out", out, (ids_shape[0], ids_shape[1] * self.head_dim), public)
            cold = self.storage.cold
            check_apart("out", out, (cold.host_view, cold.host_scales, cold.device_view,
                                     cold.device_scales))
        return fmt, out

    def keep_staging(self, num_tokens) -> None:
        """Keep the prefetch staging buffers of these batch sizes (``[T, H]`` ids with T in
        ``num_tokens``) for the table's life. Others are dropped beyond the latest few shapes;
        a CUDA graph that captured a prefetch holds its buffers' addresses, so call this with
        the captured batch sizes before capturing."""
        self.prefetcher.keep(check_integer("num_tokens", n) for n in num_tokens)

    def _gather(self, request: LookupRequest, ids, out, expected=None, worker: bool = False):
        """Gather ``ids`` into the public array ``out`` on the request's side (on the current
        stream: the caller's, or the prefetch's private one)."""
        self.storage.gather(Gather(
            request.side, ids, out.view(request.out_format.raw), request.out_format.code,
            self.row_start, self.lookup_scale(request.out_format), expected,
            worker, self.dedup, cuda_stream() if request.side is DEVICE else None,
            self.total_rows, self.bad_ids))

    def check(self) -> None:
        """Wait for the table's GPU lookups (and graph replays on each GPU's current stream),
        then raise (once) the IndexError of an id outside ``[0, total_rows)`` one met: the
        point that never misses one (``bad_ids``; the next call raises it only once run)."""
        self.bad_ids.check(self.total_rows)
        self.storage.raise_pending()

    def lookup_scale(self, out_format: Format) -> np.float32:
        """The float32 scale lookups to ``out_format`` multiply by (``scale_rounding``; a
        block-scaled format's global scale is never rounded first, as in vLLM's kernel)."""
        if self.scale is None:
            return np.float32(1.0)
        if self.format.blocked:
            return self.scale
        return rounded_scale(self.scale, out_format.dtype, self.scale_rounding)

    def lookup(self, ids, out=None, out_dtype=None, stream=None):
        """Rows of ``ids[T, H]`` as ``[T, H * head_dim]``: heads in order, dequantised (ids of
        any leading shape ``[..., H]`` give ``[..., H * head_dim]``, ``out`` of either shape).

        ``float(value) * scale`` is computed in float32 and rounded once (to nearest even) to
        ``out_dtype``, the scale first rounded to ``out_dtype`` unless ``scale_rounding`` is
        ``"float32"``: by default float32 for float32 tables, float16 for float16 tables and
        bfloat16 for bfloat16 and float8 ones (or the dtype of ``out``). NumPy ids give a NumPy
        array, CuPy ids a CuPy array (bfloat16 as raw uint16 bits), torch ids a torch tensor
        (bfloat16 typed), and a given ``out`` is what is returned. GPU lookups run on
        ``stream`` (default: torch's current stream for torch ids, else CuPy's) without a host
        sync. After a ``prefetch`` of the same shape, the result lives in the prefetch's buffer
        (or is copied to ``out``) and only the heads whose ids changed, or whose rows were
        written since the prefetch began (``write_rows``, an optimizer step), are gathered again;
        that buffer is reused by the next prefetch of the same shape. Ids of other shards (in
        ``[0, total_rows)``) give zero rows; an id outside ``[0, total_rows)`` is an IndexError
        naming the first (``row_ids``). A GPU lookup does not wait for its kernel: the
        kernel notes the id in the table's persistent word (``bad_ids``), raised by the table's
        first call after the GPU ran the lookup, or by ``check()``, which waits for it.
        A lookup waits for the row updates an asynchronous optimizer has pending (and raises an
        error one of them raised); heads whose rows were updated after the joined prefetch
        began are gathered again.
        """
        request = LookupRequest.checked(self, ids, out, out_dtype, stream)
        self.wait_for_updates()  # every update issued before this lookup lands first
        written = self.writers.take()
        with request.call.on():
            target = self.prefetcher.finish(
                request.side, request.call.stream, request.ids, request.out_format.code,
                request.out, lambda i, rows, expected: self._gather(
                    request, i, rows, regather_written(written, expected)))
            if target is None:
                target = request.out
                if target is None:
                    target = request.side.empty(request.shape,
                                                public_dtype(request.side, request.out_format))
                self._gather(request, request.ids, target)
        return request.returned(target)

    def prefetch(self, ids, out=None, out_dtype=None, stream=None) -> None:
        """Start gathering ``ids`` now, so that the next ``lookup`` of them finds them ready.

        On the GPU the gather runs on a private stream once ``stream`` (the caller's) reaches
        this point; on the CPU, on a worker thread. ``ids`` may change afterwards: a copy is
        gathered (ids outside ``[0, total_rows)`` are refused as by ``lookup``). Rows go to
        ``out`` when given (pass the same ``out`` to ``lookup``), else to a staging buffer kept
        per shape (see ``keep_staging``). On the GPU this returns once the gather is queued
        (bad ids surface as ``lookup``'s). Errors in the worker (CPU) surface at the next
        ``lookup`` or ``prefetch``, whatever ids it passes: such an IndexError begins "the
        earlier prefetch of ids of shape (T, H)" and names the prefetch's id. In a CUDA graph
        capture, capture the ``lookup`` that consumes a prefetch in the same graph. The gather
        first waits (on the worker) for the row updates issued before it.
        """
        request = LookupRequest.checked(self, ids, out, out_dtype, stream)
        with request.call.on():
            self.storage.will_read(request.ids, self.row_start,
                                   cuda_stream() if request.side is DEVICE else None)
            self.prefetcher.issue(
                request.side, request.call.stream, request.ids, request.shape,
                public_dtype(request.side, request.out_format), request.out_format.code,
                request.out,
                lambda i, rows, worker: (self.writers.settle(),  # updates issued before it
                                         self._gather(request, i, rows, worker=worker)))
            self.writers.prefetching()

    start_prefetch = prefetch

    def close(self) -> None:
        """Finish any prefetch and release the storage's registrations (pinned memory: the
        table is then unusable on the GPU), after the GPU lookups still running; refused
        (RuntimeError) while a stream that looks the table up is capturing a CUDA graph.

        A CUDA graph that captured lookups reads the rows at every replay, which the library
        cannot see: close the table (or drop its last reference) only once no such graph will
        be replayed again (destroy the graph first).
        """
        if self.storage.readers.capturing():
            raise RuntimeError("cannot close the table while a stream that looks it up is "
                               "capturing a CUDA graph: close it after the capture (and after "
                               "the graph's last replay)")
        self.writers.settle()
        self.prefetcher.close()
        self.storage.wait_for_readers("close the table")
        self.closed = True  # first: a lookup racing the close gets the closed table's error
        self.storage.close()

    def check_errors(self) -> None:
        """Deprecated: ``check()`` (the name until this release), which it calls."""
        warnings.warn("EmbeddingTable.check_errors() is deprecated: call check()",
                      DeprecationWarning, stacklevel=2)
        self.check()

    def __enter__(self) -> EmbeddingTable:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        scale = "" if self.scale is None else f", scale={float(self.scale)}"
        return (f"{type(self).__name__}(rows=[{self.row_start}, "
                f"{self.row_start + self.num_rows}) of {self.total_rows}, "
                f"head_dim={self.head_dim}, dtype={self.format.name}{scale}, "
                f"placement={self.placement!r}{', pinned' if self.pinned else ''})")
