"""GPU sections (need CuPy and a CUDA device): ids, GPU-resident and pinned-host gathers."""

from __future__ import annotations

from functools import partial

import numpy as np

import ngram_cupy as nc

from .data import RELEASED, RELEASED_HEAD_DIM, RELEASED_HEADS, released_batch, zipf_ids
from .report import Row, Section
from .timers import device_copy_seconds, gpu_timeit, graph_seconds, timeit


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

    # One timing method for all four: the stand-in layer is a cuBLAS call, which no CUDA graph
    # can capture, so every case is timed by events on the stream.
    alone = gpu_timeit(layer)
    gather = gpu_timeit(partial(table.lookup, ids, out=out))
    after = gpu_timeit(serial)
    beside = gpu_timeit(overlapped)
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

    from ngram_cupy.memory.pinned import PinnedBuffer

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
    registered = {}
    for num_tokens in (256, 4096, 65536):
        ids = cupy.asarray(rng.integers(0, rows, (num_tokens, RELEASED_HEADS)))
        out = cupy.empty((num_tokens, width), cupy.uint16)
        seconds = registered[num_tokens] = graph_seconds(partial(table.lookup, ids, out=out))
        read = ids.size * RELEASED_HEAD_DIM
        section.rows.append(Row(
            case=f"UVA gather, {num_tokens:,} tokens, uniform ids", seconds=seconds,
            rate=f"{read / seconds / 1e9:.1f} GB/s",
            notes=f"{read / seconds / bandwidth:.0%} of the pinned cudaMemcpy bandwidth "
                  f"({rows:,}-row table, {table.nbytes / 2**30:.1f} GiB)", tokens=num_tokens))
    section.rows.extend(large_page_rows(rng, rows, bandwidth, registered))
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




def large_page_rows(rng, rows: int, bandwidth: float, registered: dict[int, float]) -> list:
    """The UVA gather from a table in large GPU pages (``cuMemCreate`` on the GPU's host NUMA
    node) against the same gather from registered memory and the pinned copy floor."""
    import warnings

    import cupy

    from ngram_cupy.formats import storage_format
    from ngram_cupy.memory.large_pages import LargePageBuffer
    from ngram_cupy.tables.storage.pinned import PinnedStorage

    with warnings.catch_warnings(record=True) as refused:
        warnings.simplefilter("always")
        storage = PinnedStorage(rows, RELEASED_HEAD_DIM, storage_format("float8_e4m3fn"),
                                gpu_pages="large")
    if not isinstance(storage.buffer, LargePageBuffer):
        storage.close()
        reason = str(refused[0].message) if refused else "registered memory was made"
        return [Row(case="UVA gather, large GPU pages", seconds=0.0,
                    notes=f"not measured: {reason}")]
    table = nc.EmbeddingTable(storage, scale=0.5)
    result = []
    for num_tokens in (4096, 65536):
        ids = cupy.asarray(rng.integers(0, rows, (num_tokens, RELEASED_HEADS)))
        out = cupy.empty((num_tokens, RELEASED_HEADS * RELEASED_HEAD_DIM), cupy.uint16)
        seconds = graph_seconds(partial(table.lookup, ids, out=out))
        read = ids.size * RELEASED_HEAD_DIM
        result.append(Row(
            case=f"UVA gather, large GPU pages ({storage.buffer.granularity >> 20} MiB), "
                 f"{num_tokens:,} tokens, uniform ids", seconds=seconds,
            rate=f"{read / seconds / 1e9:.1f} GB/s",
            notes=f"{read / seconds / bandwidth:.0%} of the pinned cudaMemcpy bandwidth; "
                  f"registered memory {registered[num_tokens] * 1e6:,.0f} us "
                  f"({registered[num_tokens] / seconds:.2f}x)", tokens=num_tokens))
    table.close()
    return result


def nvfp4_table(rows: int, placement: str, hot_rows=None):
    """An NVFP4 table of the released row shape (random bytes, finite block scales)."""
    rng = np.random.default_rng(7)
    packed = rng.integers(0, 256, (rows, RELEASED_HEAD_DIM // 2), dtype=np.uint8)
    scales = rng.integers(0, 0x7F, (rows, RELEASED_HEAD_DIM // 16), dtype=np.uint8)
    return nc.EmbeddingTable(packed, dtype="nvfp4", block_scales=scales, scale=0.5,
                             placement=placement, hot_rows=hot_rows)


def bench_nvfp4_gpu(quick: bool) -> Section:
    """NVFP4 -> bf16 gathers (one 96-byte record a row: 80 packed bytes + 10 block scales,
    padded) against fp8 rows of the same count: in device memory, in pinned host memory over
    UVA, tiered (hot rows on the GPU), and the fused ids + gather kernel; CUDA graph replays."""
    import cupy

    rows = 1 << (22 if quick else 25)
    section = Section(f"NVFP4 table gather, GPU: {rows:,} rows, 16 records of 96 bytes per "
                      "token -> bf16, against fp8 (16 x 160 bytes)", "gpu")
    rng = np.random.default_rng(8)
    width = RELEASED_HEADS * RELEASED_HEAD_DIM
    for placement in ("gpu", "pinned"):
        four = nvfp4_table(rows, placement)
        eight = nc.EmbeddingTable.empty(rows, RELEASED_HEAD_DIM, "float8_e4m3fn",
                                        placement=placement, scale=0.5)
        for num_tokens in (256, 4096, 65536):
            ids = cupy.asarray(rng.integers(0, rows, (num_tokens, RELEASED_HEADS)))
            out = cupy.empty((num_tokens, width), cupy.uint16)
            t4 = graph_seconds(partial(four.lookup, ids, out=out))
            t8 = graph_seconds(partial(eight.lookup, ids, out=out))
            read = ids.size * 96
            section.rows.append(Row(
                case=f"{placement}, {num_tokens:,} tokens", seconds=t4,
                rate=f"{read / t4 / 1e9:.1f} GB/s of records", tokens=num_tokens,
                notes=f"fp8 {t8 * 1e6:,.1f} us: nvfp4 / fp8 {t4 / t8:.2f}"))
        four.close()
        eight.close()
    hot = np.sort(rng.choice(rows, rows // 8, replace=False)).astype(np.int64)
    tiered = nvfp4_table(rows, "pinned", hot_rows=hot)
    for num_tokens in (4096, 65536):
        ids = cupy.asarray(zipf_ids(rng, num_tokens, rows))
        out = cupy.empty((num_tokens, width), cupy.uint16)
        seconds = graph_seconds(partial(tiered.lookup, ids, out=out))
        section.rows.append(Row(case=f"tiered (1/8 of rows hot), {num_tokens:,} Zipf tokens",
                                seconds=seconds, tokens=num_tokens,
                                rate=f"{ids.size * 96 / seconds / 1e9:.1f} GB/s of records",
                                notes="hot rows from GPU memory, the rest over UVA"))
    tiered.close()
    config = nc.NGramConfig(**{**RELEASED.__dict__, "ngram_vocab_size_base": 1_000_000})
    layout = nc.layer_layout(config, 0)
    table = nvfp4_table(layout.padded_rows, "gpu")
    plain = nc.NGramEmbedding(layout, table)
    fused = nc.NGramEmbedding(layout, table, fused=True)
    for num_requests, length in [(256, 1), (16, 256)]:
        tokens, starts, context = (cupy.asarray(a) for a in released_batch(num_requests, length))
        out = cupy.empty((tokens.size, width), cupy.uint16)
        split = graph_seconds(partial(plain.forward, tokens, starts, context, out=out))
        one = graph_seconds(partial(fused.forward, tokens, starts, context, out=out))
        section.rows.append(Row(
            case=f"fused ids + gather, {num_requests} x {length} tokens", seconds=one,
            rate=f"{tokens.size / one / 1e9:.2f} Gtoken/s", tokens=tokens.size,
            notes=f"ids then gather {split * 1e6:,.1f} us ({split / one:.2f}x)"))
    return section
