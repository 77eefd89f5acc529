"""Host tables shared by processes, and huge pages.

- ``shared-cpu``: four processes load one fp8 checkpoint table (1 GiB; 64 MiB quick) with
  ``placement="shared"``. The first fills the segment; the other three start once it is filled
  and attach. Reported: the fill and attach times (the attach call alone, not process start-up)
  and the segment's resident memory summed over the four (Pss from ``/proc/<pid>/smaps``: a
  page shared by four counts a quarter in each), against one table; private pinned tables
  would hold four.
- ``hugepages-cpu``: the CPU fp8 -> bf16 gather of 65,536 tokens (16 heads x 160 bytes) from one
  table in transparent huge pages and one in 4 KiB pages (``NGRAM_CUPY_HUGE_PAGES=0``), timed in
  alternating rounds; the notes give how much of each table the kernel really backed with huge
  pages (``AnonHugePages``).
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
from dataclasses import asdict

import ml_dtypes
import numpy as np

import ngram_cupy as nc
from ngram_cupy.memory import shared as shared_memory
from ngram_cupy.memory.anonymous import HUGE_PAGES_ENV

from .data import RELEASED_HEAD_DIM, RELEASED_HEADS, random_fp8_rows, rotating
from .report import Row, Section
from .timers import paired

PROCESSES = 4
WAIT_S = 600


def table_config(target_bytes: int) -> nc.NGramConfig:
    """A config whose layer 0 is an fp8 table of about ``target_bytes``: 4 heads of 256-byte
    rows (embedding_dim 1024), about ``target_bytes / 1024`` rows each."""
    return nc.NGramConfig(
        vocab_size=1000, ngram_size=3, heads_per_ngram=2,
        ngram_vocab_size_base=target_bytes // 256 // 4, eos_token_id=0, embedding_dim=1024,
        make_ngram_vocab_size_divisible_by=64, split_ngram_parts=4,
        ple_embedding_dtype="float8_e4m3fn",
    )


def load_shared(path: str, config: dict, ready, done, results) -> None:
    """One process: load the table shared, report ``(created, seconds, table bytes)``; once all
    are loaded (``ready``), report the segment's ``(Rss, Pss)``, then wait for ``done``."""
    table = nc.load_ngram_embedding(path, nc.NGramConfig(**config), 0, placement="shared").table
    int(table.host_view.view(np.uint8).reshape(-1)[::4096].sum())  # map every page (as pinning)
    segment = table.storage.segment
    results.put(("loaded", segment.created, segment.seconds, table.nbytes))
    ready.wait()
    results.put(("resident", *shared_memory.resident_bytes(segment.path)))
    done.wait()
    table.close()


def bench_shared_cpu(quick: bool) -> Section:
    """Fill and attach times, and summed resident memory, of four processes sharing a table."""
    config = table_config((64 << 20) if quick else (1 << 30))
    layout = nc.layer_layout(config, 0)
    spawn = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as folder:
        weight = np.random.default_rng(0).integers(
            0, 256, (layout.padded_rows, layout.head_dim), dtype=np.uint8).view(
            ml_dtypes.float8_e4m3fn)
        nc.save_ngram_embedding(folder, config, 0, weight, np.float32(0.5))
        del weight
        ready, done, results = spawn.Barrier(PROCESSES + 1), spawn.Event(), spawn.Queue()
        args = (folder, asdict(config), ready, done, results)
        processes = [spawn.Process(target=load_shared, args=args)]
        processes[0].start()
        loads = [results.get(timeout=WAIT_S)]  # the first fills before the others start
        processes += [spawn.Process(target=load_shared, args=args)
                      for _ in range(PROCESSES - 1)]
        for process in processes[1:]:
            process.start()
        loads += [results.get(timeout=WAIT_S) for _ in processes[1:]]
        ready.wait(WAIT_S)
        resident = [results.get(timeout=WAIT_S) for _ in processes]
        done.set()
        for process in processes:
            process.join(WAIT_S)
    table_bytes = loads[0][3]
    fill = loads[0][2]
    attaches = [seconds for _, _, seconds, _ in loads[1:]]
    pss = sum(p for _, _, p in resident)
    rss = sum(r for _, r, _ in resident)
    section = Section(f"one table per node: {PROCESSES} processes load a "
                      f"{table_bytes / (1 << 30):.2f} GiB fp8 table with placement='shared'",
                      "cpu")
    section.rows.append(Row(case="first process: create and fill", seconds=fill,
                            rate=f"{table_bytes / fill / 1e9:.2f} GB/s",
                            notes=f"created by the first: {loads[0][1]}"))
    section.rows.append(Row(case="processes 2-4: attach (slowest)", seconds=max(attaches),
                            rate=f"{max(attaches) / fill:.2%} of the fill",
                            notes=f"created: {[created for _, created, _, _ in loads[1:]]}"))
    section.rows.append(Row(case="resident, summed over the 4 (Pss)", seconds=0.0,
                            rate=f"{pss / table_bytes:.2f} x the table",
                            notes=f"{pss / (1 << 20):,.0f} MiB (Rss summed: "
                                  f"{rss / table_bytes:.2f} x, each maps all of it); private "
                                  f"pinned copies: {PROCESSES:.2f} x"))
    return section


def huge_page_bytes(array: np.ndarray) -> int:
    """``AnonHugePages`` of the mapping holding ``array`` (from ``/proc/self/smaps``)."""
    address = array.ctypes.data
    inside, total = False, 0
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split(None, 1)[0]
            if not head.endswith(":"):
                low, high = (int(part, 16) for part in head.split("-"))
                inside = low <= address < high
            elif inside and head == "AnonHugePages:":
                total += int(line.split()[1]) * 1024
    return total


def host_table(weight: np.ndarray, huge_pages: bool) -> nc.EmbeddingTable:
    """A CPU table filled from ``weight``, its memory allocated with huge pages on or off."""
    previous = os.environ.get(HUGE_PAGES_ENV)
    os.environ[HUGE_PAGES_ENV] = "1" if huge_pages else "0"
    try:
        table = nc.EmbeddingTable.empty(*weight.shape, ml_dtypes.float8_e4m3fn, scale=0.5)
    finally:
        if previous is None:
            del os.environ[HUGE_PAGES_ENV]
        else:
            os.environ[HUGE_PAGES_ENV] = previous
    table.write_rows(0, weight)
    return table


def bench_huge_pages_cpu(quick: bool) -> Section:
    """The CPU gather from a table in huge pages against one in 4 KiB pages, same run."""
    rng = np.random.default_rng(0)
    rows = 1 << (20 if quick else 22)  # 4M rows of 160 bytes: 640 MiB
    weight = random_fp8_rows(rng, rows)
    huge, small = host_table(weight, True), host_table(weight, False)
    del weight
    num_tokens = 65_536
    batches = [rng.integers(0, rows, (num_tokens, RELEASED_HEADS)) for _ in range(4)]
    out = np.empty((num_tokens, RELEASED_HEADS * RELEASED_HEAD_DIM), ml_dtypes.bfloat16)
    with_huge, with_small, ratio = paired(rotating(batches, lambda i: huge.lookup(i, out=out)),
                                          rotating(batches, lambda i: small.lookup(i, out=out)))
    section = Section(f"huge pages, CPU gather: {rows:,} fp8 rows, {num_tokens:,} tokens x 16 "
                      "x 160 bytes -> bf16", "cpu")
    moved = batches[0].size * RELEASED_HEAD_DIM + out.nbytes
    for case, seconds, table, notes in (
            ("transparent huge pages", with_huge, huge, f"{ratio:.2f} x the 4 KiB time (paired "
                                                        "median)"),
            ("4 KiB pages (NGRAM_CUPY_HUGE_PAGES=0)", with_small, small, "")):
        backed = huge_page_bytes(table.host_view) / table.nbytes
        section.rows.append(Row(case=case, seconds=seconds, tokens=num_tokens,
                                rate=f"{moved / seconds / 1e9:.2f} GB/s",
                                notes=f"{backed:.0%} of the table in huge pages; {notes}".strip()
                                .rstrip(";")))
    return section
