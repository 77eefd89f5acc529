"""CPU sections: ids and gathers under four load conditions, and the command line end to end."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from functools import partial

import ml_dtypes
import numpy as np

import ngram_cupy as nc
from ngram_cupy.hashing import reference

from .conditions import conditions, one_thread
from .data import (
    CORPUS,
    RELEASED,
    RELEASED_HEAD_DIM,
    RELEASED_HEADS,
    random_fp8_rows,
    released_batch,
    rotating,
)
from .report import Row, Section
from .timers import copy_floor, paired, per_call, timeit

FORMATS_NVFP4_ROW = RELEASED_HEAD_DIM // 2 + RELEASED_HEAD_DIM // 16  # 90 bytes a row
IDS_CASES = [(1, 4096), (32, 512), (256, 1), (1, 1 << 20)]
IDS_CASES_QUICK = [(1, 4096), (32, 512), (256, 1), (1, 1 << 18)]
GATHER_TOKENS = (256, 4096, 65536)
GATHER_TOKENS_QUICK = (256, 4096)


def bench_ids_cpu(quick: bool) -> Section:
    """Fast CPU ids: the default call against one thread in each condition; idle, against the
    NumPy reference and the output-sized copy floor."""
    layout = nc.layer_layout(RELEASED, 0)
    section = Section("n-gram ids, CPU (Numba), released config layer 0", "cpu")
    calls = []
    for num_requests, length in IDS_CASES_QUICK if quick else IDS_CASES:
        tokens, starts, context = released_batch(num_requests, length)
        out = np.empty((tokens.size, layout.num_heads), dtype=np.int64)
        calls.append((f"{num_requests} x {length:,} tokens", tokens.size,
                      partial(nc.compute_ngram_ids, layout, tokens, starts, context, out=out),
                      partial(reference.compute_ngram_ids, layout, tokens, starts, context),
                      out.nbytes))
    for condition, load in conditions():
        with load():
            for case, num_tokens, call, slow, nbytes in calls:
                fast, single, ratio = paired(call, one_thread(call))
                notes = ""
                if condition == "idle":
                    ref = timeit(slow, min_time=0.05, max_calls=4)
                    notes = (f"{ref / fast:.0f}x the NumPy reference; "
                             f"{copy_floor(nbytes) / fast:.0%} of the copy floor")
                section.rows.append(Row(case=case, seconds=fast, one_thread=single, ratio=ratio,
                                        condition=condition, tokens=num_tokens,
                                        rate=f"{num_tokens / fast / 1e6:.1f} Mtoken/s",
                                        notes=notes))
    return section


def engram_bench_layout() -> nc.EngramLayout:
    """A DeepSeek-sized Engram layout: 3 layers of trigrams x 8 heads (16 ids per layer, as the
    released Qwen4Exp layer) over a 129,280-id map onto 99,092 compressed ids (the map's values
    do not change the speed; DeepSeek's tokenizer is not needed)."""
    from ngram_cupy.hashing.token_map import TokenMap

    ids = (np.arange(129_280) % 99_092).astype(np.int32)
    config = nc.EngramConfig([2, 14, 26], 3, 8, 64, 600_000, [9_700_000] * 3, 99_092, 1)
    return nc.engram_layout(config, TokenMap(ids, 99_092, "benchmark"))


def bench_engram_ids_cpu(quick: bool) -> Section:
    """Engram ids of every layer in one call against one thread, and per layer against the
    Qwen4Exp ids of the same tokens (timed in alternation), in each condition."""
    layout = engram_bench_layout()
    qwen = nc.layer_layout(RELEASED, 0)
    num_tokens = (1 << 18) if quick else (1 << 20)
    tokens, starts, context = released_batch(1, num_tokens)
    engram_tokens = tokens % layout.vocab_size
    positions = np.arange(num_tokens, dtype=np.int64)
    out = np.empty((num_tokens, layout.num_layers, layout.num_heads), dtype=np.int32)
    qwen_out = np.empty((num_tokens, qwen.num_heads), dtype=np.int64)
    engram = partial(nc.compute_engram_ids, layout, engram_tokens, positions, starts, out=out)
    qwen_ids = partial(nc.compute_ngram_ids, qwen, tokens, starts, context, out=qwen_out)
    layers = layout.num_layers
    section = Section(f"Engram ids, CPU (Numba): {layers} layers x {layout.num_heads} ids per "
                      f"token in one call, against Qwen4Exp ids (released layer 0, "
                      f"{qwen.num_heads} ids)", "cpu")
    for condition, load in conditions():
        with load():
            fast, single, ratio = paired(engram, one_thread(engram))
            _, qwen_seconds, over_qwen = paired(engram, qwen_ids)
            per_layer = layers / over_qwen  # Qwen4Exp seconds over Engram seconds per layer
            layer_rate = layers * num_tokens / fast / 1e6
            section.rows.append(Row(
                case=f"1 x {num_tokens:,} tokens, {layers} layers", seconds=fast,
                one_thread=single, ratio=ratio, condition=condition, tokens=num_tokens,
                rate=f"{num_tokens / fast / 1e6:.1f} Mtoken/s ({layer_rate:.1f} per layer)",
                notes=f"per layer {per_layer:.2f}x the Qwen4Exp ids' Mtoken/s "
                      f"({num_tokens / qwen_seconds / 1e6:.1f} Mtoken/s)"))
    return section


def bench_gather_cpu(quick: bool) -> Section:
    """Numba fp8 -> bf16 gather of the released row shape: the default call against one thread
    in each condition; idle, against NumPy ``table[ids]`` and the copy floor of the output."""
    rng = np.random.default_rng(0)
    rows = 1 << (20 if quick else 22)  # 4M rows: 640 MiB, far out of every cache
    weight = random_fp8_rows(rng, rows)
    table = nc.EmbeddingTable(weight, scale=0.5)
    section = Section(f"table gather, CPU (Numba): {rows:,} fp8 rows, 16 x 160 bytes per token "
                      "-> bf16; each call reads other rows", "cpu")
    calls = []
    for num_tokens in GATHER_TOKENS_QUICK if quick else GATHER_TOKENS:
        count = max(1, (64 << 20) // (num_tokens * RELEASED_HEADS * RELEASED_HEAD_DIM))
        batches = [rng.integers(0, rows, (num_tokens, RELEASED_HEADS)) for _ in range(count)]
        out = np.empty((num_tokens, RELEASED_HEADS * RELEASED_HEAD_DIM), ml_dtypes.bfloat16)
        calls.append((num_tokens, batches, out))
    for condition, load in conditions():
        with load():
            for num_tokens, batches, out in calls:
                call = rotating(batches, partial(table.lookup, out=out))
                fast, single, ratio = paired(call, one_thread(call))
                notes = ""
                if condition == "idle":
                    fancy = timeit(rotating(batches, weight.__getitem__))
                    notes = (f"{copy_floor(out.nbytes) / fast:.0%} of the copy floor of the "
                             f"output; NumPy table[ids] (fp8 rows copied, not dequantised) "
                             f"{fancy * 1e6:,.0f} us")
                moved = batches[0].size * RELEASED_HEAD_DIM + out.nbytes  # rows in + output
                section.rows.append(Row(case=f"{num_tokens:,} tokens", seconds=fast,
                                        one_thread=single, ratio=ratio, condition=condition,
                                        rate=f"{moved / fast / 1e9:.2f} GB/s", tokens=num_tokens,
                                        notes=notes))
    return section


def bench_nvfp4_gather_cpu(quick: bool) -> Section:
    """Numba NVFP4 -> bf16 gather of the released row shape (80 packed bytes + 10 block scales a
    row) against the fp8 gather of the same rows, timed in alternating pairs in each condition,
    and against the copy floor of the output; and MXFP8 -> bf16 (160 E4M3 bytes + 5 UE8M0 scales
    a row) against fp8 the same way."""
    rng = np.random.default_rng(3)
    rows = 1 << (20 if quick else 22)
    num_tokens = 4096 if quick else 65536
    fp8 = nc.EmbeddingTable(random_fp8_rows(rng, rows), scale=0.5)
    packed = rng.integers(0, 256, (rows, RELEASED_HEAD_DIM // 2), dtype=np.uint8)
    scales = rng.integers(0, 0x7F, (rows, RELEASED_HEAD_DIM // 16), dtype=np.uint8)
    nvfp4 = nc.EmbeddingTable(packed, dtype="nvfp4", block_scales=scales, scale=0.5)
    del packed, scales
    mxfp8 = nc.EmbeddingTable(random_fp8_rows(rng, rows), dtype="mxfp8", block_scales=rng.integers(
        112, 135, (rows, RELEASED_HEAD_DIM // 32), dtype=np.uint8))  # 2**-15 .. 2**7
    section = Section(f"NVFP4 and MXFP8 table gathers, CPU (Numba): {rows:,} rows, "
                      f"{num_tokens:,} tokens x 16 heads -> bf16, against fp8 rows", "cpu")
    count = max(1, (64 << 20) // (num_tokens * RELEASED_HEADS * RELEASED_HEAD_DIM))
    batches = [rng.integers(0, rows, (num_tokens, RELEASED_HEADS)) for _ in range(count)]
    out = np.empty((num_tokens, RELEASED_HEADS * RELEASED_HEAD_DIM), ml_dtypes.bfloat16)
    floor = copy_floor(out.nbytes)
    for condition, load in conditions():
        with load():
            four, eight, ratio = paired(rotating(batches, partial(nvfp4.lookup, out=out)),
                                        rotating(batches, partial(fp8.lookup, out=out)))
            notes = (f"nvfp4 / fp8 {ratio:.2f} (fp8 {eight * 1e6:,.0f} us); output copy floor "
                     f"{floor * 1e6:,.0f} us: nvfp4 {floor / four:.0%}, fp8 {floor / eight:.0%}")
            moved = batches[0].size * FORMATS_NVFP4_ROW + out.nbytes
            section.rows.append(Row(case=f"{num_tokens:,} tokens, {condition}", seconds=four,
                                    rate=f"{moved / four / 1e9:.2f} GB/s", tokens=num_tokens,
                                    notes=notes))
            mx, eight, ratio = paired(rotating(batches, partial(mxfp8.lookup, out=out)),
                                      rotating(batches, partial(fp8.lookup, out=out)))
            moved = batches[0].size * (RELEASED_HEAD_DIM + RELEASED_HEAD_DIM // 32) + out.nbytes
            section.rows.append(Row(case=f"mxfp8, {num_tokens:,} tokens, {condition}",
                                    seconds=mx, rate=f"{moved / mx / 1e9:.2f} GB/s",
                                    tokens=num_tokens,
                                    notes=f"mxfp8 / fp8 {ratio:.2f} (fp8 {eight * 1e6:,.0f} us)"))
    return section


def pyarrow_floor(corpus: str, written: str, options: dict, folder: str) -> Callable[[], None]:
    """pyarrow reading the input and writing the CLI's own output table again, with the CLI's
    writer options, into a new file of ``folder``."""
    import pyarrow.parquet as pq

    table = pq.read_table(written)
    path = os.path.join(folder, "floor.parquet")

    def read_and_write() -> None:
        pq.read_table(corpus)
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
        pq.write_table(table, path, **options)

    return read_and_write


def bench_parquet_e2e(quick: bool) -> Section:
    """``ngram-cupy ids`` on data/, Parquet to Parquet, against pyarrow reading the input and
    writing the same output table (the floor), timed in alternation; and the ids kernel alone."""
    import pyarrow.parquet as pq

    from ngram_cupy.cli.main import main as cli_main
    from ngram_cupy.files.pipeline import writer_options

    corpus = str(CORPUS)
    config = str(CORPUS.parent / "config.json")
    tokens_column = pq.read_table(corpus, columns=["tokens"]).column("tokens").combine_chunks()
    tokens = tokens_column.values.to_numpy()
    starts = tokens_column.offsets.to_numpy()
    layout = nc.layer_layout(nc.NGramConfig.from_hf(config), 0)
    context = np.full((starts.size - 1, 2), layout.eos_token_id, dtype=np.int64)
    out = np.empty((tokens.size, layout.num_heads), dtype=np.int64)
    kernel = timeit(lambda: nc.compute_ngram_ids(layout, tokens, starts, context, out=out))
    section = Section("end to end: `ngram-cupy ids` on data/ (Parquet to Parquet)", "cpu")
    with tempfile.TemporaryDirectory() as folder:
        output = os.path.join(folder, "ids.parquet")
        argv = ["ids", corpus, output, "--config", config, "--doc-id-column", "doc_id",
                "--quiet"]
        cli_main(argv)
        written = os.path.getsize(output)
        options = writer_options(pq.read_schema(output), pq.read_schema(corpus))
        floor_call = pyarrow_floor(corpus, output, options, folder)

        def command() -> None:
            """The command writing a new OUTPUT, as the floor writes a new file (renamed over an
            existing file, ext4 also writes the new one's data to disk at the rename)."""
            os.remove(output)
            cli_main(argv)

        # Alternating pairs: a busy neighbour slows the command and its floor alike, and the
        # median of the pairs' ratios follows a load that changes between pairs.
        command()
        floor_call()
        pairs = [(per_call(command, 1), per_call(floor_call, 1))
                 for _ in range(5 if quick else 15)]
        seconds, floor = (float(np.median(times)) for times in zip(*pairs, strict=True))
        ratio = float(np.median([first / second for first, second in pairs]))
    section.rows.append(Row(
        case=f"{tokens.size:,} tokens, 1 layer, {layout.num_heads} ids per token",
        seconds=seconds,
        rate=f"{tokens.size / seconds / 1e6:.2f} Mtoken/s",
        notes=f"{ratio:.2f}x the floor (median of paired ratios): pyarrow reading the input and "
              f"writing the same table ({floor * 1e3:,.0f} ms); {written / 1e6:.1f} MB of "
              f"Parquet out; the ids kernel alone takes {kernel / seconds:.0%} of the time",
    ))
    return section
