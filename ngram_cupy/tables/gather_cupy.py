"""GPU gather of table rows: launches ``kernels/gather.cu`` through a CuPy ``RawModule``.

The table may live in device memory or in page-locked host memory mapped into the GPU (UVA): the
kernel is the same. Every instantiation (storage format, output format, load width, id type) is
compiled at once per GPU architecture, on first use, by NVRTC into the kernel cache
(``runtime.kernel_cache``): later processes load the cubin from there.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from functools import cache
from itertools import product
from pathlib import Path

import numpy as np

from ..codecs.dequant import FORMATS, OUTPUT_CODES
from ..codecs.scales import require_block_scales
from ..runtime import kernel_cache, nvrtc
from ..runtime.backends import cupy_module, data_address
from ..runtime.kernel_cache import entry_key
from .row_ids import UNCHECKED, check_row_ids

# kernels/ at the top of a source checkout; installed wheels carry it as ngram_cupy/kernels.
_PACKAGE = Path(__file__).resolve().parents[1]
KERNEL_DIR = next(p for p in (_PACKAGE / "kernels", _PACKAGE.parent / "kernels") if p.is_dir())
THREADS_PER_BLOCK = 256
COUNTER_LANES = 64  # counter pairs a tiered gather spreads its atomics over (hot_rows.cuh)
VECTOR_BYTES = (16, 8, 4, 2, 1)
ID_TYPES = {np.dtype(np.int32): "int", np.dtype(np.int64): "long long"}
NVRTC_OPTIONS = ("-std=c++17",)
_INCLUDE = re.compile(r'^#include "([^"]+)"$', re.MULTILINE)


def kernel_source(name: str) -> str:
    """A ``kernels/`` file with its local ``#include "..."`` headers pasted in.

    Pasting (rather than ``-I``) makes the header part of the text CuPy hashes for its compile
    cache, so editing a header recompiles.
    """
    text = (KERNEL_DIR / name).read_text()
    return _INCLUDE.sub(lambda match: kernel_source(match.group(1)), text)


def instance_name(code: int, out_code: int, vector_bytes: int, id_dtype,
                  tiered: bool = False) -> str:
    """The C++ name of one instantiation of ``gather_rows`` (``gather_tiered_rows``)."""
    kernel = "gather_tiered_rows" if tiered else "gather_rows"
    return f"{kernel}<{code}, {out_code}, {vector_bytes}, {ID_TYPES[np.dtype(id_dtype)]}>"


def all_instances() -> list[str]:
    """Every instantiation the library can launch (the compile check builds them all)."""
    return [
        instance_name(fmt.code, out_code, vector_bytes, id_dtype, tiered)
        for tiered, fmt, out_code, vector_bytes, id_dtype in product(
            (False, True), FORMATS, OUTPUT_CODES, VECTOR_BYTES, ID_TYPES)
        if vector_bytes >= fmt.itemsize
    ]


def module_build(arch: str) -> dict[str, str | bytes]:
    """``{"image", "names"}`` of gather.cu with every instance for ``arch`` (``sm_90``): the
    cubin and its lowered names (JSON), from the kernel cache or compiled by NVRTC there."""
    source = kernel_source("gather.cu")
    instances = all_instances()
    key = entry_key("nvrtc", "gather.cu", hashlib.sha256(source.encode()).hexdigest(),
                    tuple(instances), NVRTC_OPTIONS, arch, nvrtc.nvrtc_version())

    def build() -> dict[str, str | bytes]:
        image, lowered = nvrtc.compile_cubin(source, "gather.cu", instances, arch,
                                             NVRTC_OPTIONS)
        return {"image": image, "names": json.dumps(lowered)}

    return kernel_cache.KERNELS.fetch(
        key, build, lambda fields: isinstance(fields.get("image"), bytes)
        and isinstance(fields.get("names"), str))


@cache
def _module(device_id: int):
    """gather.cu loaded on one device: ``(module, {instance: lowered name})``, or ``(RawModule,
    None)`` compiled by CuPy where cuda-bindings' NVRTC is missing."""
    cupy = cupy_module()
    with cupy.cuda.Device(device_id) as device:
        if nvrtc.nvrtc_version() == "none":
            return cupy.RawModule(code=kernel_source("gather.cu"), options=NVRTC_OPTIONS,
                                  name_expressions=all_instances()), None
        build = module_build(f"sm_{device.compute_capability}")
        module = cupy.cuda.function.Module()
        module.load(build["image"])
        return module, json.loads(build["names"])


@cache
def _kernel(name: str, device_id: int):
    """One instantiation on one device."""
    module, lowered = _module(device_id)
    return module.get_function(name if lowered is None else lowered[name])


def vector_bytes(row_bytes: int, itemsize: int, out_itemsize: int, table_address: int,
                 out_address: int, pack: int = 1) -> int:
    """Widest load (<= 16 bytes) that divides the row and keeps every load and store aligned
    (``pack`` values per stored element)."""
    for width in VECTOR_BYTES:
        store = min(16, width // itemsize * pack * out_itemsize)
        if (width >= itemsize and row_bytes % width == 0 and table_address % width == 0
                and out_address % store == 0):
            return width
    raise ValueError("table rows are not aligned to their value size")


def row_stride(*named) -> int:
    """Bytes from one row to the next in every 2-D array of ``named`` (``(name, array)`` pairs
    read with one stride: a table and its hot tier): the row's own bytes, or a packed record's
    (``packed``: rows and block scales are views into records). Rows must be contiguous and
    apart; a ValueError naming the array otherwise."""
    strides = set()
    for name, rows in named:
        width = rows.shape[1] * rows.dtype.itemsize
        if rows.shape[1] > 1 and rows.strides[1] != rows.dtype.itemsize or (
                rows.shape[0] > 1 and rows.strides[0] < width):
            raise ValueError(f"{name} must have contiguous rows, got strides {rows.strides}")
        strides.add(rows.strides[0] if rows.shape[0] > 1 else None)
    strides.discard(None)
    if len(strides) > 1:
        raise ValueError(f"{' and '.join(name for name, _ in named)} must have one row stride, "
                         f"got {sorted(strides)} bytes")
    return strides.pop() if strides else named[0][1].shape[1] * named[0][1].dtype.itemsize


@dataclass(frozen=True)
class Launch:
    """One kernel launch, fully decided: what CuPy launches on a GPU and the host build runs."""

    name: str  # the template instance (see ``instance_name``)
    grid: int
    block: int
    args: tuple  # the kernel's parameters in order: arrays (passed as pointers) and NumPy scalars


def launch_plan(table, code: int, row_start: int, scale, ids, out, out_code: int,
                expected=None, hot=None, counts=None, scales=None,
                hot_scales=None, total_rows=None, bad=None) -> Launch | None:
    """The launch that gathers ``table[ids - row_start]`` into ``out``; None when there is nothing
    to do. Works on CuPy or NumPy arrays alike (only shapes, dtypes, strides and addresses are
    read). With ``hot = ((words, ranks), hot rows)``, the tiered gather counting into ``counts``.
    A block-scaled table's rows come with their ``scales`` (and a hot tier's ``hot_scales``).
    The kernel steps from row to row by the arrays' own row strides (``row_stride``): packed
    records' views and two arrays take the same kernel.
    With ``total_rows`` and ``bad`` (a uint64 word, ``row_ids.NO_BAD_WORD`` before the launch),
    the kernel notes there the first position of an id outside ``[0, total_rows)``."""
    require_block_scales(FORMATS[code], scales, hot, hot_scales)
    num_items = ids.size
    rows, row_width = table.shape
    if num_items == 0 or row_width == 0:
        return None
    itemsize = table.dtype.itemsize
    stride = row_stride(("table", table), *(() if hot is None else (("hot rows", hot[1]),)))
    scale_stride = 0 if scales is None else row_stride(
        ("scales", scales), *(() if hot_scales is None else (("hot_scales", hot_scales),)))
    address = data_address(table) | stride | (0 if hot is None else data_address(hot[1]))
    width = vector_bytes(row_width * itemsize, itemsize, out.dtype.itemsize, address,
                         data_address(out), FORMATS[code].pack)
    chunks = row_width * itemsize // width
    blocks = -(-num_items * chunks // THREADS_PER_BLOCK)
    args = (table, np.int64(rows), np.int64(row_start), ids,
            np.uint64(0) if expected is None else expected, np.int64(num_items),
            np.int32(chunks), np.int64(stride), np.int64(scale_stride), np.float32(scale), out)
    if hot is not None:
        (words, ranks), hot_table = hot
        args += (words, ranks, hot_table, counts)
    args += (np.uint64(0) if scales is None else scales,)
    if hot is not None:
        args += (np.uint64(0) if hot_scales is None else hot_scales,)
    checked = total_rows is not None and bad is not None
    args += (np.int64(total_rows if checked else UNCHECKED), bad if checked else np.uint64(0))
    name = instance_name(code, out_code, width, ids.dtype, hot is not None)
    return Launch(name, blocks, THREADS_PER_BLOCK, args)


def gather_rows(table, code: int, row_start: int, scale, ids, out, out_code: int,
                expected=None, stream=None, hot=None, counts=None, scales=None,
                hot_scales=None, total_rows=None, bad_ids=None):
    """Launch the gather: raw rows ``table[ids - row_start]`` dequantised into raw ``out``.

    ``table`` is a CuPy ``[rows, head_dim]`` array of raw bits (device memory or mapped host
    memory; its rows contiguous, any row stride: views into packed records, ``packed``, are read
    in place), ``ids`` a C-contiguous ``[T, H]`` int32/int64 CuPy array, ``out`` a C-contiguous raw
    ``[T, H * head_dim]`` CuPy array; ``expected`` an optional int64 ``[T, H]`` array of ids whose
    rows ``out`` already holds. With ``hot = ((words, ranks), hot rows)`` (CuPy; see
    ``hot_rows``) hot rows are read from the hot rows and each row read is counted in ``counts``
    (uint64 ``[COUNTER_LANES, 2]``: hot, cold). Block-scaled rows (``[rows, head_dim / pack]``)
    come with their ``scales`` (``[rows, head_dim / block]``; ``hot_scales`` for the hot tier).
    Runs on ``stream`` (default: CuPy's current stream) with no host synchronisation. With
    ``total_rows`` and ``bad_ids`` (the table's ``BadIds``), the kernel notes the first id
    outside ``[0, total_rows)`` in ``bad_ids``' persistent word of the GPU, raised later
    (``bad_ids``: at the table's next call once the GPU ran this one, or ``check``); without
    ``bad_ids`` ids are not checked.
    """
    cupy = cupy_module()
    stream = stream if stream is not None else cupy.cuda.get_current_stream()
    device = ids.device.id
    bad = None if total_rows is None or bad_ids is None else bad_ids.word(device, stream)
    plan = launch_plan(table, code, row_start, scale, ids, out, out_code, expected, hot, counts,
                       scales, hot_scales, total_rows, bad)
    if plan is None:
        return out
    kernel = _kernel(plan.name, device)
    with cupy.cuda.Device(device):  # the module's context is the arrays' device's
        kernel((plan.grid,), (plan.block,), plan.args, stream=stream)
    if bad is not None:
        bad_ids.noted(device, stream)
    return out


def gather_unique_rows(table, code: int, row_start: int, scale, ids, out, out_code: int,
                       stream=None, scales=None, total_rows=None):
    """The gather with repeated ids fetched once: each row crosses PCIe (or HBM) a single time.

    ``cupy.unique`` finds the distinct ids (its result size makes it wait for the GPU, so this
    path is for large batches and cannot be captured in a CUDA graph); the distinct rows are
    gathered and dequantised into a scratch block, which the same kernel then expands to ``out``.
    With ``total_rows``, ids outside ``[0, total_rows)`` are refused first (``row_ids``; this
    path waits for the GPU anyway).
    """
    cupy = cupy_module()
    if ids.size == 0:
        return out
    if total_rows is not None:
        check_row_ids(ids, total_rows, held=(row_start, row_start + table.shape[0]))
    with stream if stream is not None else cupy.cuda.get_current_stream():
        unique, inverse = cupy.unique(ids.ravel(), return_inverse=True)
        head_dim = table.shape[1] * FORMATS[code].pack
        rows = cupy.empty((unique.size, head_dim), dtype=out.dtype)
        gather_rows(table, code, row_start, scale, unique.reshape(-1, 1), rows, out_code,
                    scales=scales)
        gather_rows(rows, out_code, 0, 1.0, inverse.reshape(ids.shape), out, out_code)
    return out
