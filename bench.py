"""Benchmarks for ngram_cupy: prints one table per section and writes BENCHMARKS.md.

Every figure is measured in the same run as its baselines (the NumPy reference, a plain memory
copy of the same size), so ratios hold on any machine. Usage:

    python bench.py                 # every section that this machine can run
    python bench.py --quick         # small sizes, for a smoke run
    python bench.py --device gpu    # GPU sections only (needs CuPy and a device)
    python bench.py --sections ids-cpu --output -   # one section, no file written
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import ml_dtypes
import numpy as np

import ngram_cupy as nc
from ngram_cupy import reference

RELEASED = nc.NGramConfig(
    vocab_size=248320, ngram_size=3, heads_per_ngram=8, ngram_vocab_size_base=20_000_000,
    eos_token_id=248044, embedding_dim=2560, make_ngram_vocab_size_divisible_by=512,
    split_ngram_parts=128,
)


@dataclass
class Row:
    """One measured case: what ran, how long one call took, and how it compares."""

    case: str
    seconds: float
    rate: str
    notes: str = ""
    tokens: int = 0  # tokens per call, for the throughput plot (0: not plotted)


@dataclass
class Section:
    """A named group of rows with the device it ran on."""

    title: str
    device: str
    rows: list[Row] = field(default_factory=list)


def timeit(fn: Callable[[], object], min_time: float = 0.3, max_calls: int = 100_000) -> float:
    """Median seconds per call of ``fn`` over repeated batches lasting at least ``min_time``."""
    fn()  # warm-up: compilation, first-touch page faults
    calls = 1
    while True:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        elapsed = time.perf_counter() - start
        if elapsed >= min_time / 5 or calls >= max_calls:
            break
        calls *= 4
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls)
    return float(np.median(samples))


def released_batch(num_requests: int, tokens_per_request: int, seed: int = 0):
    """A packed batch of random valid tokens (2% EOS) for the released config."""
    rng = np.random.default_rng(seed)
    num_tokens = num_requests * tokens_per_request
    tokens = rng.integers(0, RELEASED.vocab_size, num_tokens, dtype=np.int64)
    tokens[rng.random(num_tokens) < 0.02] = RELEASED.eos_token_id
    starts = np.arange(0, num_tokens + 1, tokens_per_request, dtype=np.int64)
    context = rng.integers(0, RELEASED.vocab_size, (num_requests, RELEASED.ngram_size - 1))
    return tokens, starts, context


def copy_floor(nbytes: int) -> float:
    """Seconds to copy ``nbytes`` once between two preallocated host arrays: the memory floor."""
    source = np.ones(nbytes // 8, dtype=np.int64)
    target = np.empty_like(source)
    return timeit(lambda: np.copyto(target, source))


def bench_ids_cpu(quick: bool) -> Section:
    """Fast CPU ids against the NumPy reference and the output-sized copy floor."""
    layout = nc.layer_layout(RELEASED, 0)
    section = Section("n-gram ids, CPU (Numba), released config layer 0", "cpu")
    cases = [(1, 4096), (32, 512), (256, 1), (1, 1 << 20), (2048, 512)]
    if quick:
        cases = [(1, 4096), (32, 512), (256, 1), (1, 1 << 16)]
    for num_requests, length in cases:
        tokens, starts, context = released_batch(num_requests, length)
        out = np.empty((tokens.size, layout.num_heads), dtype=np.int64)
        batch = (layout, tokens, starts, context)
        fast = timeit(partial(nc.compute_ngram_ids, *batch, out=out))
        slow = timeit(partial(reference.compute_ngram_ids, *batch), min_time=0.05)
        floor = copy_floor(out.nbytes)
        section.rows.append(Row(
            case=f"{num_requests} x {length} tokens",
            seconds=fast,
            rate=f"{tokens.size / fast / 1e6:.1f} Mtoken/s",
            notes=f"{slow / fast:.0f}x the NumPy reference; {floor / fast:.0%} of the copy floor",
            tokens=tokens.size,
        ))
    return section


def bench_parquet_e2e(quick: bool) -> Section:
    """``ngram-cupy ids`` on data/, Parquet to Parquet, against the ids kernel alone."""
    import tempfile

    import pyarrow.parquet as pq

    from ngram_cupy.cli import main as cli_main

    corpus = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data",
                          "stdlib_docstrings.parquet")
    config = os.path.join(os.path.dirname(corpus), "config.json")
    tokens_column = pq.read_table(corpus, columns=["tokens"]).column("tokens").combine_chunks()
    tokens = tokens_column.values.to_numpy()
    starts = tokens_column.offsets.to_numpy()
    layout = nc.layer_layout(nc.NGramConfig.from_hf(config), 0)
    context = np.full((starts.size - 1, 2), layout.eos_token_id, dtype=np.int64)
    out = np.empty((tokens.size, layout.num_heads), dtype=np.int64)
    kernel = timeit(lambda: nc.compute_ngram_ids(layout, tokens, starts, context, out=out))
    section = Section("end to end: `ngram-cupy ids` on data/ (Parquet to Parquet, zstd)", "cpu")
    with tempfile.TemporaryDirectory() as folder:
        output = os.path.join(folder, "ids.parquet")
        argv = ["ids", corpus, output, "--config", config, "--doc-id-column", "doc_id",
                "--quiet"]
        seconds = timeit(lambda: cli_main(argv), min_time=1.0)
        written = os.path.getsize(output)
    section.rows.append(Row(
        case=f"{tokens.size:,} tokens, 1 layer, {layout.num_heads} ids per token",
        seconds=seconds,
        rate=f"{tokens.size / seconds / 1e6:.2f} Mtoken/s",
        notes=f"{tokens.nbytes / seconds / 1e6:.1f} MB/s of int32 tokens in, "
              f"{written / seconds / 1e6:.0f} MB/s of Parquet out ({written / 1e6:.1f} MB); "
              f"the ids kernel alone takes {kernel / seconds:.0%} of the time",
    ))
    return section


def gpu_timeit(fn: Callable[[], object], min_time: float = 0.2) -> float:
    """Median seconds per call of ``fn``, by CUDA events around batches of calls on the current
    stream: the GPU time when the GPU is busier than the host, else the host's launch rate."""
    import cupy

    stream = cupy.cuda.get_current_stream()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()

    def batch(calls: int) -> float:
        start.record(stream)
        for _ in range(calls):
            fn()
        end.record(stream)
        end.synchronize()
        return cupy.cuda.get_elapsed_time(start, end) / 1e3

    batch(1)  # warm-up: compilation, the layer's constants
    calls = 1
    while batch(calls) < min_time / 5 and calls < 100_000:
        calls *= 4
    return float(np.median([batch(calls) / calls for _ in range(5)]))


def graph_seconds(fn: Callable[[], object], calls: int = 20) -> float:
    """GPU seconds per call of ``fn`` alone: ``calls`` calls captured in a CUDA graph, replayed."""
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        fn()  # warm-up outside the capture: compilation, the layer's constants
        stream.synchronize()
        stream.begin_capture()
        try:
            for _ in range(calls):
                fn()
        finally:  # a failed capture must still end, or the stream stays in capture mode
            graph = stream.end_capture()
        return gpu_timeit(graph.launch) / calls


def device_copy_seconds(nbytes: int) -> float:
    """Seconds to copy ``nbytes`` between two device buffers (cudaMemcpyAsync), by CUDA events."""
    import cupy

    source = cupy.ones(nbytes // 8, dtype=np.int64)
    target = cupy.empty_like(source)
    return gpu_timeit(lambda: target.data.copy_from_device_async(source.data, nbytes))


def bench_ids_gpu(quick: bool) -> Section:
    """GPU ids (Numba CUDA) against a device-to-device copy; the decode step's latency."""
    import cupy

    layout = nc.layer_layout(RELEASED, 0)
    section = Section("n-gram ids, GPU (Numba CUDA), released config layer 0", "gpu")
    cases = [(256, 1), (16, 256), (64, 1024), (1024, 1024)]
    if quick:
        cases = cases[:3]
    largest = max(r * n for r, n in cases) * layout.num_heads * 8
    copy = device_copy_seconds(largest)
    bandwidth = 2 * largest / copy  # bytes read + written per second
    section.rows.append(Row(
        case=f"device-to-device copy, {largest / 2**20:.0f} MiB", seconds=copy,
        rate=f"{bandwidth / 1e9:.0f} GB/s", notes="read + write: the bandwidth below is against",
    ))
    for num_requests, length in cases:
        batch = released_batch(num_requests, length)
        tokens, starts, context = (cupy.asarray(a) for a in batch)
        out = cupy.empty((tokens.size, layout.num_heads), dtype=np.int64)
        call = partial(nc.compute_ngram_ids, layout, tokens, starts, context, out=out)
        kernel = graph_seconds(call)
        moved = out.nbytes + tokens.nbytes  # ids written + tokens read
        section.rows.append(Row(
            case=f"{num_requests} x {length} tokens", seconds=kernel,
            rate=f"{tokens.size / kernel / 1e9:.2f} Gtoken/s",
            notes=f"kernel alone (CUDA graph replay): {moved / kernel / 1e9:.0f} GB/s, "
                  f"{moved / kernel / bandwidth:.0%} of the copy bandwidth; "
                  f"{gpu_timeit(call) * 1e6:,.1f} us per call made from Python",
            tokens=tokens.size,
        ))
    tokens, starts, context = (cupy.asarray(a) for a in released_batch(256, 1))
    out = cupy.empty((256, layout.num_heads), dtype=np.int64)
    stream = cupy.cuda.get_current_stream()
    decode = partial(nc.compute_ngram_ids, layout, tokens, starts, context, out=out)

    def decode_and_wait():
        decode()
        stream.synchronize()

    host = timeit(decode)
    stream.synchronize()
    section.rows.append(Row(
        case="decode step, 256 x 1 tokens: host time per call", seconds=host,
        rate=f"{1 / host / 1e3:.0f} k calls/s",
        notes="Python checks + Numba launch, calls queued without waiting",
    ))
    latency = timeit(decode_and_wait)
    section.rows.append(Row(
        case="decode step, 256 x 1 tokens: call to result", seconds=latency,
        rate=f"{1 / latency / 1e3:.0f} k calls/s", notes="one call, then a stream synchronize",
    ))
    return section


RELEASED_HEADS, RELEASED_HEAD_DIM = 16, 160  # 16 rows of 160 fp8 bytes per token


def random_fp8_rows(rng, rows: int) -> np.ndarray:
    """``[rows, 160]`` random float8 e4m3 rows (NaN codes included: they cost the same)."""
    return rng.integers(0, 256, (rows, RELEASED_HEAD_DIM), dtype=np.uint8).view(
        ml_dtypes.float8_e4m3fn)


def rotating(batches: list, fn: Callable) -> Callable[[], object]:
    """``fn`` applied to the next batch on each call: timed calls do not find their rows cached."""
    turn = iter(range(1 << 62))
    return lambda: fn(batches[next(turn) % len(batches)])


def bench_gather_cpu(quick: bool) -> Section:
    """Numba gather of the released row shape against NumPy ``table[ids]`` and the copy floor."""
    rng = np.random.default_rng(0)
    rows = 1 << (20 if quick else 22)  # 4M rows: 640 MiB, far out of every cache
    weight = random_fp8_rows(rng, rows)
    table = nc.EmbeddingTable(weight, scale=0.5)
    section = Section(f"table gather, CPU (Numba): {rows:,} fp8 rows, 16 x 160 bytes per token "
                      "-> bf16; each call reads other rows", "cpu")
    for num_tokens in (256, 4096) if quick else (256, 4096, 65536):
        count = max(1, (64 << 20) // (num_tokens * RELEASED_HEADS * RELEASED_HEAD_DIM))
        batches = [rng.integers(0, rows, (num_tokens, RELEASED_HEADS)) for _ in range(count)]
        out = np.empty((num_tokens, RELEASED_HEADS * RELEASED_HEAD_DIM), ml_dtypes.bfloat16)
        fast = timeit(rotating(batches, partial(table.lookup, out=out)))
        fancy = timeit(rotating(batches, weight.__getitem__))
        floor = copy_floor(out.nbytes)
        moved = batches[0].size * RELEASED_HEAD_DIM + out.nbytes  # rows read + output written
        section.rows.append(Row(
            case=f"{num_tokens:,} tokens", seconds=fast,
            rate=f"{moved / fast / 1e9:.2f} GB/s",
            notes=f"{fast / fancy:.1f}x the time of NumPy table[ids] (fp8 rows copied, not "
                  f"dequantised: {fancy * 1e6:,.0f} us); {floor / fast:.0%} of the copy floor "
                  "of the output",
            tokens=num_tokens,
        ))
    return section


def best_gpu_seconds(fn: Callable[[], object]) -> float:
    """GPU seconds per call from a CUDA graph replay, or by events when ``fn`` cannot be
    captured (a cuBLAS call, say)."""
    try:
        return graph_seconds(fn)
    except Exception:
        return gpu_timeit(fn)


def released_table_on_gpu(quick: bool):
    """``(layout, table)``: the released layer 0 in GPU memory (47.7 GiB, unfilled) when it
    fits, else a layer with fewer rows; contents do not change the timings."""
    import cupy

    config = RELEASED
    free = cupy.cuda.runtime.memGetInfo()[0]
    if quick or nc.layer_layout(config, 0).table_nbytes(1) > 0.6 * free:
        config = nc.NGramConfig(**{**RELEASED.__dict__, "ngram_vocab_size_base": 1_000_000})
    layout = nc.layer_layout(config, 0)
    table = nc.EmbeddingTable.empty(layout.padded_rows, RELEASED_HEAD_DIM, "float8_e4m3fn",
                                    placement="gpu", scale=0.5)
    return layout, table


def bench_gather_gpu(quick: bool) -> Section:
    """GPU-resident fp8 gather against the copy bandwidth, the fused kernel against ids then
    gather, CuPy ``take`` / torch ``index_select`` baselines, and the decode step."""
    import cupy

    layout, table = released_table_on_gpu(quick)
    rows = table.num_rows
    section = Section(f"table gather, GPU-resident: {rows:,} fp8 rows ({table.nbytes / 2**30:.1f}"
                      " GiB), 16 x 160 bytes per token -> bf16", "gpu")
    copy_bytes = 1 << 29
    copy = device_copy_seconds(copy_bytes)
    bandwidth = 2 * copy_bytes / copy
    section.rows.append(Row(case="device-to-device copy, 512 MiB", seconds=copy,
                            rate=f"{bandwidth / 1e9:.0f} GB/s", notes="read + write"))
    try:
        import torch

        use_torch = torch.cuda.is_available()
    except ImportError:
        use_torch = False
    rng = np.random.default_rng(1)
    raw = table.device_rows
    for num_tokens in (256, 4096) if quick else (256, 4096, 65536, 262144):
        ids = cupy.asarray(rng.integers(0, rows, (num_tokens, RELEASED_HEADS)))
        out = cupy.empty((num_tokens, RELEASED_HEADS * RELEASED_HEAD_DIM), cupy.uint16)
        gather = graph_seconds(partial(table.lookup, ids, out=out))
        moved = ids.size * RELEASED_HEAD_DIM + out.nbytes + ids.nbytes
        flat = ids.ravel()
        taken = cupy.empty((flat.size, RELEASED_HEAD_DIM), cupy.uint8)
        take = gpu_timeit(partial(cupy.take, raw, flat, axis=0, out=taken))
        notes = (f"{moved / gather / bandwidth:.0%} of the copy bandwidth; cupy.take of the raw "
                 f"fp8 rows (no dequantisation) {take * 1e6:,.1f} us")
        if use_torch:
            rows_t, flat_t = torch.from_dlpack(raw), torch.from_dlpack(flat)
            selected = torch.empty((flat.size, RELEASED_HEAD_DIM), dtype=torch.uint8,
                                   device="cuda")
            index = gpu_timeit(partial(torch.index_select, rows_t, 0, flat_t, out=selected))
            notes += f", torch.index_select {index * 1e6:,.1f} us"
        section.rows.append(Row(case=f"gather, {num_tokens:,} tokens", seconds=gather,
                                rate=f"{moved / gather / 1e9:.0f} GB/s", notes=notes,
                                tokens=num_tokens))
    plain = nc.NGramEmbedding(layout, table)
    fused = nc.NGramEmbedding(layout, table, fused=True)
    cases = [(256, 1), (16, 256)] if quick else [(256, 1), (16, 256), (64, 1024)]
    for num_requests, length in cases:
        tokens, starts, context = (cupy.asarray(a) for a in released_batch(num_requests, length))
        out = cupy.empty((tokens.size, RELEASED_HEADS * RELEASED_HEAD_DIM), cupy.uint16)
        split = graph_seconds(partial(plain.forward, tokens, starts, context, out=out))
        one = graph_seconds(partial(fused.forward, tokens, starts, context, out=out))
        section.rows.append(Row(
            case=f"fused ids + gather, {num_requests} x {length} tokens", seconds=one,
            rate=f"{tokens.size / one / 1e9:.2f} Gtoken/s",
            notes=f"ids then gather (two launches) {split * 1e6:,.1f} us: the fused kernel is "
                  f"{split / one:.2f}x as fast", tokens=tokens.size))
    tokens, starts, context = (cupy.asarray(a) for a in released_batch(256, 1))
    out = cupy.empty((256, RELEASED_HEADS * RELEASED_HEAD_DIM), cupy.uint16)
    step = partial(plain.forward, tokens, starts, context, out=out)
    stream = cupy.cuda.get_current_stream()

    def step_and_wait():
        step()
        stream.synchronize()

    section.rows.append(Row(case="decode step, 256 tokens: ids + gather on the GPU",
                            seconds=graph_seconds(step), rate="",
                            notes="CUDA graph replay (goal: under 20 us)"))
    section.rows.append(Row(case="decode step, 256 tokens: host time per call",
                            seconds=timeit(step), rate="",
                            notes="argument checks + two launches, queued without waiting"))
    section.rows.append(Row(case="decode step, 256 tokens: call to result",
                            seconds=timeit(step_and_wait), rate="",
                            notes="one call, then a stream synchronize"))
    return section


def zipf_ids(rng, num_tokens: int, rows: int):
    """Ids of a Zipf-distributed token stream (repeats like text), folded into ``rows``."""
    layout = nc.layer_layout(RELEASED, 0)
    tokens = (rng.zipf(1.2, num_tokens) - 1) % RELEASED.vocab_size
    context = np.full((1, 2), RELEASED.eos_token_id)
    return nc.compute_ngram_ids(layout, tokens, np.array([0, num_tokens]), context) % rows


def overlap_row(table, ids, weights) -> Row:
    """A stand-in decoder layer (one matmul) alone, with the table's prefetch running beside it,
    and with the gather serialised after it."""
    import cupy

    num_tokens = ids.shape[0]
    hidden = cupy.ones((num_tokens, weights.shape[0]), cupy.float16)
    product = cupy.empty((num_tokens, weights.shape[1]), cupy.float16)
    out = cupy.empty((num_tokens, ids.shape[1] * table.head_dim), cupy.uint16)

    def layer():
        cupy.matmul(hidden, weights, out=product)

    def serial():
        layer()
        table.lookup(ids, out=out)

    def overlapped():
        table.prefetch(ids, out=out)
        layer()
        table.lookup(ids, out=out)

    alone = best_gpu_seconds(layer)
    gather = best_gpu_seconds(partial(table.lookup, ids, out=out))
    after = best_gpu_seconds(serial)
    beside = best_gpu_seconds(overlapped)
    return Row(
        case=f"overlap, {num_tokens:,} tokens: layer + prefetched gather", seconds=beside,
        rate=f"{(after - beside) / gather:.0%} of the gather hidden",
        notes=f"layer alone ({num_tokens} x {weights.shape[0]} @ {weights.shape[0]} x "
              f"{weights.shape[1]} fp16) {alone * 1e6:,.0f} us; gather alone "
              f"{gather * 1e6:,.0f} us; serialised {after * 1e6:,.0f} us (goal: at least 90% "
              "hidden)")


def bench_host_gpu(quick: bool) -> Section:
    """Pinned host table read over UVA: H2D bandwidth, gather, de-duplication, and overlap of
    the prefetch with a stand-in decoder layer."""
    import cupy

    from ngram_cupy.pinned import PinnedBuffer

    section = Section("pinned host table, UVA gather over PCIe (16 x 160-byte fp8 rows per "
                      "token -> bf16)", "gpu")
    copy_bytes = 1 << (28 if quick else 30)
    with PinnedBuffer(copy_bytes) as pinned:
        target = cupy.empty(copy_bytes, cupy.uint8)
        runtime = cupy.cuda.runtime
        h2d = gpu_timeit(lambda: runtime.memcpyAsync(
            target.data.ptr, pinned.pointer, copy_bytes, runtime.memcpyHostToDevice,
            cupy.cuda.get_current_stream().ptr))
        target = None
    bandwidth = copy_bytes / h2d
    section.rows.append(Row(case=f"cudaMemcpy host-to-device from pinned memory, "
                                 f"{copy_bytes >> 20} MiB", seconds=h2d,
                            rate=f"{bandwidth / 1e9:.1f} GB/s", notes="the PCIe bandwidth below "
                                                                      "is against"))
    rng = np.random.default_rng(2)
    rows = 1 << (22 if quick else 25)
    # Left as the zero pages pinning faults in: the contents do not change the timings.
    table = nc.EmbeddingTable.empty(rows, RELEASED_HEAD_DIM, "float8_e4m3fn", placement="host",
                                    scale=0.5)
    width = RELEASED_HEADS * RELEASED_HEAD_DIM
    for num_tokens in (256, 4096, 65536):
        ids = cupy.asarray(rng.integers(0, rows, (num_tokens, RELEASED_HEADS)))
        out = cupy.empty((num_tokens, width), cupy.uint16)
        seconds = graph_seconds(partial(table.lookup, ids, out=out))
        read = ids.size * RELEASED_HEAD_DIM
        section.rows.append(Row(
            case=f"UVA gather, {num_tokens:,} tokens, uniform ids", seconds=seconds,
            rate=f"{read / seconds / 1e9:.1f} GB/s",
            notes=f"{read / seconds / bandwidth:.0%} of the pinned cudaMemcpy bandwidth "
                  f"({rows:,}-row table, {table.nbytes / 2**30:.1f} GiB)", tokens=num_tokens))
    for num_tokens in (4096, 65536):
        ids = cupy.asarray(zipf_ids(rng, num_tokens, rows))
        distinct = int(cupy.unique(ids).size) / ids.size
        out = cupy.empty((num_tokens, width), cupy.uint16)
        table.dedup = False
        plain = gpu_timeit(partial(table.lookup, ids, out=out))
        table.dedup = True
        unique = gpu_timeit(partial(table.lookup, ids, out=out))
        table.dedup = False
        read = ids.size * RELEASED_HEAD_DIM
        section.rows.append(Row(
            case=f"UVA gather with de-duplication, {num_tokens:,} Zipf tokens", seconds=unique,
            rate=f"{read / unique / 1e9:.1f} GB/s effective",
            notes=f"{distinct:.0%} of the ids distinct; without de-duplication "
                  f"{plain * 1e6:,.0f} us ({plain / unique:.2f}x)"))
    hidden_size, ffn_size = 4096, 12288  # a stand-in decoder layer: one fp16 matmul
    weights = cupy.ones((hidden_size, ffn_size), cupy.float16)
    for num_tokens in (256, 4096):
        ids = cupy.asarray(rng.integers(0, rows, (num_tokens, RELEASED_HEADS)))
        section.rows.append(overlap_row(table, ids, weights))
    table.close()
    return section



# Each section: (name, device it needs, function). Add new ones here.
SECTIONS: list[tuple[str, str, Callable[[bool], Section]]] = [
    ("ids-cpu", "cpu", bench_ids_cpu),
    ("ids-gpu", "gpu", bench_ids_gpu),
    ("parquet-e2e", "cpu", bench_parquet_e2e),
    ("gather-cpu", "cpu", bench_gather_cpu),
    ("gather-gpu", "gpu", bench_gather_gpu),
    ("host-gpu", "gpu", bench_host_gpu),
]


def gpu_available() -> bool:
    """Whether CuPy is importable and sees at least one CUDA device."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def machine_summary() -> str:
    """One line naming the host (and the GPU when there is one)."""
    import numba

    line = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
            f"Python {platform.python_version()}, NumPy {np.__version__}, "
            f"Numba {numba.__version__} ({numba.get_num_threads()} threads)")
    if gpu_available():
        import cupy

        props = cupy.cuda.runtime.getDeviceProperties(0)
        line += f"; GPU {props['name'].decode()}, CuPy {cupy.__version__}"
    return line


def render(section: Section) -> str:
    """One section as a markdown table."""
    lines = [f"### {section.title}", "", "| case | time per call | rate | compared with |",
             "|---|---:|---:|---|"]
    for row in section.rows:
        lines.append(f"| {row.case} | {row.seconds * 1e6:,.1f} us | {row.rate} | {row.notes} |")
    return "\n".join(lines) + "\n"


MARK = "<!-- section: {} -->"


def merge_into(path: str, fresh: dict[str, str]) -> None:
    """Rewrite ``path`` atomically, replacing the sections just run and keeping the others."""
    blocks: dict[str, str] = {}
    if os.path.exists(path):
        text = open(path, encoding="utf-8").read()
        for name, _, _ in SECTIONS:
            start = text.find(MARK.format(name))
            if start >= 0:
                end = text.find("<!-- section: ", start + 1)
                blocks[name] = text[start : end if end >= 0 else len(text)].rstrip() + "\n"
    blocks.update(fresh)
    body = "\n".join(blocks[name] for name, _, _ in SECTIONS if name in blocks)
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("# Benchmarks\n\nWritten by `python bench.py`; each section says where and when it "
                "ran. Ratios compare with baselines measured in the same run.\n\n" + body)
    os.replace(tmp, path)


def plot_throughput(sections: list[Section], path: str) -> bool:
    """Write a PNG of tokens/s against tokens per call for rows that count tokens (matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    plotted = [s for s in sections if any(row.tokens for row in s.rows)]
    if not plotted:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for section in plotted:
        rows = sorted((row for row in section.rows if row.tokens), key=lambda row: row.tokens)
        ax.plot([row.tokens for row in rows], [row.tokens / row.seconds / 1e6 for row in rows],
                marker="o", label=section.title.split(":")[0])
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("tokens per call (batch size)")
    ax.set_ylabel("Mtoken/s")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.15))
    tmp = f"{path}.tmp"
    fig.savefig(tmp, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    os.replace(tmp, path)
    return True


def main(argv: list[str] | None = None) -> int:
    """Run the chosen sections, print the tables, and write them to ``--output``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto")
    parser.add_argument("--quick", action="store_true", help="small sizes only")
    parser.add_argument("--sections", help="comma-separated section names (default: all)")
    parser.add_argument("--output", default="BENCHMARKS.md", help="markdown file, or - for none")
    args = parser.parse_args(argv)

    has_gpu = gpu_available()
    if args.device == "gpu" and not has_gpu:
        print("bench.py: --device gpu asked for, but CuPy sees no CUDA device", file=sys.stderr)
        return 2
    wanted = set(args.sections.split(",")) if args.sections else None
    unknown = (wanted or set()) - {name for name, _, _ in SECTIONS}
    if unknown:
        print(f"bench.py: unknown sections {sorted(unknown)}", file=sys.stderr)
        return 2

    fresh: dict[str, str] = {}
    measured: list[Section] = []
    failed: list[str] = []
    stamp = f"{datetime.date.today().isoformat()}{', --quick' if args.quick else ''}"
    for name, device, run in SECTIONS:
        if wanted is not None and name not in wanted:
            continue
        if device == "gpu" and not has_gpu:
            print(f"[skip] {name}: no GPU")
            continue
        if args.device != "auto" and device != args.device:
            continue
        print(f"[run] {name}", flush=True)
        try:
            measured.append(run(args.quick))
        except Exception:  # one failing section must not cost the others' figures
            traceback.print_exc()
            failed.append(name)
            continue
        table = render(measured[-1])
        print(table, flush=True)
        fresh[name] = f"{MARK.format(name)}\n{table}\n_{stamp}: {machine_summary()}_\n"
        if args.output != "-":  # after each section: a run cut short keeps what it measured
            merge_into(args.output, fresh)
            print(f"wrote {args.output}", flush=True)

    if args.output != "-" and measured:
        plot = os.path.join(os.path.dirname(args.output), "benchmarks.png")
        if plot_throughput(measured, plot):
            print(f"wrote {plot}")
    if failed:
        print(f"bench.py: sections failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
