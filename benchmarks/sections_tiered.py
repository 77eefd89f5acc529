"""The hot-row tier on the CPU: host bytes read per token with K hot rows, by the counters.

Documents of a real corpus are split in two: the first half chooses the K most used rows of layer
0 (released config), the second half is looked up through a tiered gather whose counters say how
many rows came from each tier. Only the counts matter, so the table has one fp8 value per row
(the released row count, pages never written); bytes are the released 160-byte rows.
"""

from __future__ import annotations

import time

import numpy as np
import pyarrow.parquet as pq

import ngram_cupy as nc
from ngram_cupy import formats, stats
from ngram_cupy.tables import gather_numba
from ngram_cupy.tables.hot_rows import build_map

from .data import CORPUS, RELEASED, RELEASED_HEAD_DIM, RELEASED_HEADS
from .report import Row, Section

HOT_ROWS = (0, 100_000, 1_000_000, 10_000_000)


def document_ids(layout, path) -> tuple[np.ndarray, np.ndarray]:
    """``(ids of the first half of the documents, ids of the second half)``: each half packed as
    one batch of requests, one per document, from a fresh (all-EOS) context."""
    table = pq.read_table(path, columns=["doc_id", "tokens"])
    docs: dict[int, list[np.ndarray]] = {}
    for doc_id, tokens in zip(table.column("doc_id").to_numpy(),
                              table.column("tokens").to_pylist(), strict=True):
        docs.setdefault(int(doc_id), []).append(np.asarray(tokens, np.int64))
    order = sorted(docs)
    halves = []
    for chosen in (order[: len(order) // 2], order[len(order) // 2:]):
        parts = [np.concatenate(docs[d]) for d in chosen]
        tokens = np.concatenate(parts)
        starts = np.concatenate([[0], np.cumsum([p.size for p in parts])])
        context = np.full((len(parts), layout.ngram_size - 1), layout.eos_token_id, np.int64)
        halves.append(nc.compute_ngram_ids(layout, tokens, starts, context))
    return halves[0], halves[1]


def bench_tiered_cpu(quick: bool) -> Section:
    """Host bytes per token of held-out documents with K = 0, 1e5, 1e6, 1e7 hot rows."""
    path = CORPUS  # Qwen3.5 tokens of the Python standard library
    layout = nc.layer_layout(RELEASED, 0)
    profile, measured = document_ids(layout, path)
    if quick:
        measured = measured[: 1 << 16]
    fmt = formats.storage_format("float8_e4m3fn")
    rows = layout.padded_rows
    cold = np.zeros((rows, 1), fmt.raw)  # untouched pages: no memory
    row_bytes = RELEASED_HEAD_DIM * fmt.itemsize
    tokens = measured.shape[0]
    out = np.empty(measured.shape, np.uint16)
    section = Section(f"hot-row tier, CPU counters: {path.name}, released layer 0, "
                      f"{profile.shape[0]:,} tokens choose the hot rows, {tokens:,} held-out "
                      f"tokens measured ({RELEASED_HEADS} x {row_bytes}-byte rows per token)",
                      "cpu")
    counter = stats.RowCounter()
    counter.add(profile)
    profile_counts = counter.result()
    counter = stats.RowCounter()
    counter.add(measured)
    predicted = stats.hit_rate_curve(profile_counts, counter.result(), HOT_ROWS)
    baseline = None
    warm = (build_map(np.zeros(0, np.int64), 0, 1), cold[:0])
    gather_numba.gather_rows(cold[:1], fmt.code, 0, np.float32(1.0), measured[:1], out[:1],
                             formats.BFLOAT16, hot=warm)  # compile before timing
    for count, share in zip(HOT_ROWS, predicted, strict=True):
        hot = stats.hottest_rows(profile_counts, count)
        hot_map = build_map(hot, 0, rows)
        counts = np.zeros(2, np.int64)
        start = time.perf_counter()
        gather_numba.gather_rows(cold, fmt.code, 0, np.float32(1.0), measured, out,
                                 formats.BFLOAT16, hot=(hot_map, cold[hot]), counts=counts)
        seconds = time.perf_counter() - start
        hot_read, cold_read = (int(c) for c in counts)
        per_token = cold_read * row_bytes / tokens
        baseline = per_token if baseline is None else baseline
        section.rows.append(Row(
            case=f"K = {count:,} ({hot.size:,} distinct rows chosen)", seconds=seconds,
            rate=f"{per_token:,.0f} host bytes/token",
            notes=(f"{hot_read / (hot_read + cold_read):.1%} of lookups hot (stats.hit_rate_curve: "
                   f"{share:.1%}); {1 - per_token / baseline:.1%} fewer host bytes than K = 0")))
    return section


def bench_tiered_gpu(quick: bool) -> Section:
    """Lookups through a hot tier against the untiered pinned table and an all-GPU table: at 0%
    hits (the tier's overhead) and on Zipf-like ids whose hot rows another batch chose."""
    import cupy

    from .data import zipf_ids
    from .timers import graph_seconds

    rng = np.random.default_rng(3)
    rows = 1 << (22 if quick else 25)
    hot_count = 1 << (17 if quick else 20)
    width = RELEASED_HEADS * RELEASED_HEAD_DIM
    section = Section(f"hot-row tier on the GPU: {rows:,}-row fp8 table in pinned memory, "
                      f"{hot_count:,} hot rows in GPU memory (16 x 160-byte rows per token "
                      "-> bf16)", "gpu")

    def table(placement, hot_rows=None):
        """A zero table (contents do not change the timings)."""
        return nc.EmbeddingTable.empty(rows, RELEASED_HEAD_DIM, "float8_e4m3fn",
                                       placement=placement, scale=0.5, hot_rows=hot_rows)

    pinned, resident = table("pinned"), table("gpu")
    cold_only = table("pinned", np.arange(rows - hot_count, rows))  # ids below never hit
    for num_tokens in (4096, 65536):
        out = cupy.empty((num_tokens, width), cupy.uint16)
        uniform = cupy.asarray(rng.integers(0, rows - hot_count, (num_tokens, RELEASED_HEADS)))
        profile = zipf_ids(rng, num_tokens, rows)
        measured = cupy.asarray(zipf_ids(rng, num_tokens, rows))
        counter = stats.RowCounter()
        counter.add(profile)
        zipf = table("pinned", stats.hottest_rows(counter.result(), hot_count))
        base = graph_seconds(partial_lookup(pinned, uniform, out))
        zero_hits = graph_seconds(partial_lookup(cold_only, uniform, out))
        section.rows.append(Row(
            case=f"{num_tokens:,} tokens, uniform cold ids: pinned / tiered (0% hits)",
            seconds=zero_hits, rate=f"{num_tokens / zero_hits / 1e6:.2f} Mtoken/s",
            notes=f"{base / zero_hits:.2f}x the untiered pinned table ({base * 1e6:,.1f} us)",
            tokens=num_tokens))
        base = graph_seconds(partial_lookup(pinned, measured, out))
        tiered = graph_seconds(partial_lookup(zipf, measured, out))
        gpu = graph_seconds(partial_lookup(resident, measured, out))
        counts = zipf.counters
        section.rows.append(Row(
            case=f"{num_tokens:,} tokens, Zipf ids, hot rows from another batch",
            seconds=tiered, rate=f"{num_tokens / tiered / 1e6:.2f} Mtoken/s",
            notes=(f"{counts['hot_rows'] / max(sum(counts.values()), 1):.0%} hot; "
                   f"{base / tiered:.2f}x the pinned table ({base * 1e6:,.1f} us); "
                   f"{gpu / tiered:.2f}x the all-GPU table ({gpu * 1e6:,.1f} us)"),
            tokens=num_tokens))
        zipf.close()
    for done in (pinned, resident, cold_only):
        done.close()
    return section


def partial_lookup(table, ids, out):
    """``table.lookup(ids, out=out)`` as a call without arguments."""
    return lambda: table.lookup(ids, out=out)
