"""Bench section ``mmap-cold``: lookups on a mapped checkpoint table whose pages are out of memory.

The fp8 table is written once with ``save_ngram_embedding``; every case then runs in a fresh
process (``python -m benchmarks.sections_mmap CASE FOLDER SIZE``) that loads it with
``placement="mmap"``, drops the files' pages from the page cache (``posix_fadvise(DONTNEED)``),
checks with ``mincore`` that the rows' pages are gone, and reads one batch's rows cold: a plain
lookup (which reads its cold pages itself), the same with those reads switched off (every page a
fault of its own, as before), ``prefetch`` then ``lookup``, and the device's own rate: as many
random 4 KiB ``O_DIRECT`` reads of the same files by 64 threads (queue depth 64). Rates are
distinct pages per second; the cases alternate, repeated, and each row is their median, with the
median of each round's ratio to that round's device rate.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import mmap
import os
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import AbstractContextManager
from functools import partial

import ml_dtypes
import numpy as np

import ngram_cupy as nc
from ngram_cupy.memory.page_reads import page_runs, resident_pages

from .conditions import busy_processes, idle
from .data import RELEASED, RELEASED_HEAD_DIM, released_batch
from .report import Row, Section
from .timers import paired

GIB = 1 << 30
QUEUE_DEPTH = 64
CASES = ("device", "faults", "plain", "prefetch")
SIZES = {  # ngram_vocab_size_base (table rows ~ 16x it), tokens per batch, rounds
    "quick": (100_000, 1024, 1),
    "full": (1_700_000, 4096, 5),
}


def config(size: str) -> nc.NGramConfig:
    """The released config with fewer rows: 0.24 GiB of fp8 rows (quick), 4.05 GiB (full)."""
    return dataclasses.replace(RELEASED, ngram_vocab_size_base=SIZES[size][0])


def write_table(folder: str, size: str, table_config: nc.NGramConfig | None = None) -> int:
    """Layer 0's fp8 table (random bytes, a 16 MiB pattern repeated) written with the project's
    writer, synced to disk; its size in bytes. ``table_config``: another section's config."""
    table_config = config(size) if table_config is None else table_config
    layout = nc.layer_layout(table_config, 0)
    weight = np.empty((layout.padded_rows, RELEASED_HEAD_DIM), np.uint8)
    pattern = np.random.default_rng(5).integers(0, 0x7F, (1 << 24) // RELEASED_HEAD_DIM *
                                                RELEASED_HEAD_DIM, dtype=np.uint8)
    flat = weight.reshape(-1)
    for start in range(0, flat.size, pattern.size):
        piece = flat[start:start + pattern.size]
        piece[...] = pattern[:piece.size]
    nc.save_ngram_embedding(folder, table_config, 0, weight.view(ml_dtypes.float8_e4m3fn), 0.5)
    os.sync()  # dirty pages cannot be dropped: every case starts from clean, evictable ones
    return weight.nbytes


def checkpoint_files(folder: str) -> list[str]:
    """The checkpoint's safetensors files."""
    return sorted(glob.glob(os.path.join(folder, "*.safetensors")))


def evict(files: list[str]) -> None:
    """Drop the files' pages from the page cache (pages mapped by a process stay)."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def table_pages(table, ids: np.ndarray) -> list[tuple[int, int]]:
    """The page runs holding the rows of ``ids`` in a mapped table."""
    pages = table.storage.pages
    return page_runs(ids.reshape(-1) - table.row_start, pages.starts, pages.addresses,
                     pages.row_bytes, pages.num_rows)


def resident_share(runs: list[tuple[int, int]]) -> float:
    """The share of these pages in memory (``mincore``; up to 4,096 of them asked)."""
    addresses = [address + offset for address, length in runs
                 for offset in range(0, length, mmap.PAGESIZE)]
    sample = addresses[:: max(1, len(addresses) // 4096)]
    found = resident_pages(sample)
    return float("nan") if found is None else sum(found) / len(sample)


def direct_reads(files: list[str], count: int, threads: int = QUEUE_DEPTH) -> float:
    """Seconds for ``count`` random 4 KiB ``O_DIRECT`` reads over ``files`` by ``threads``
    threads (each one read in flight: queue depth ``threads``)."""
    rng = np.random.default_rng(11)
    fds = [os.open(path, os.O_RDONLY | os.O_DIRECT) for path in files]
    pages = [os.fstat(fd).st_size // mmap.PAGESIZE for fd in fds]
    which = rng.integers(0, len(fds), count)
    offsets = (rng.random(count) * np.array(pages)[which]).astype(np.int64) * mmap.PAGESIZE
    jobs = iter(zip(which.tolist(), offsets.tolist(), strict=True))
    lock = threading.Lock()

    def work() -> None:
        buffer = mmap.mmap(-1, mmap.PAGESIZE)  # page-aligned, as O_DIRECT needs
        while True:
            with lock:
                job = next(jobs, None)
            if job is None:
                return
            os.preadv(fds[job[0]], [buffer], job[1])

    workers = [threading.Thread(target=work) for _ in range(threads)]
    start = time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    seconds = time.perf_counter() - start
    for fd in fds:
        os.close(fd)
    return seconds


def measure_case(case: str, folder: str, size: str) -> dict:
    """In this fresh process: one cold read of a batch's rows by ``case``."""
    layout = nc.layer_layout(config(size), 0)
    tokens, starts, context = released_batch(1, SIZES[size][1], seed=3)
    ids = nc.compute_ngram_ids(layout, tokens, starts, context)
    table = nc.load_ngram_embedding(folder, config(size), 0, placement="mmap").table
    table.lookup(np.arange(16).reshape(1, 16))  # compiled before timing (these pages stay)
    files = checkpoint_files(folder)
    runs = table_pages(table, ids)
    pages = sum(length for _, length in runs) // mmap.PAGESIZE
    evict(files)
    before = resident_share(runs)
    result = {"pages": pages, "resident_before": before}
    if case == "device":
        result["seconds"] = direct_reads(files, pages)
        return result
    if case == "faults":  # the library's own reads switched off: one fault per page
        table.storage.pages.read_cold = lambda local: False
    start = time.perf_counter()
    if case == "prefetch":
        table.prefetch(ids)
    table.lookup(ids)
    result["seconds"] = time.perf_counter() - start
    if case == "plain":  # warm now: the residency check against none, paired
        result["warm_ratio"] = warm_ratio(table, ids)
        result["warm_ratio_one"] = warm_ratio(table, ids[:1])
    table.close()
    return result


def warm_ratio(table, ids: np.ndarray) -> float:
    """Paired median of a warm lookup's time with the residency check over one without."""
    checked = table.storage.pages.read_cold

    def without() -> None:
        table.storage.pages.read_cold = lambda local: False
        table.lookup(ids)
        table.storage.pages.read_cold = checked

    return paired(lambda: table.lookup(ids), without, min_time=1.0, rounds=11)[2]


def run_cases(folder: str, size: str, rounds: int) -> dict[str, list[dict]]:
    """Every case ``rounds`` times, in alternation, each in a fresh process."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [root, *filter(None, [os.environ.get("PYTHONPATH")])])}
    results: dict[str, list[dict]] = {case: [] for case in CASES}
    for _ in range(rounds):
        for case in CASES:
            done = subprocess.run([sys.executable, "-m", "benchmarks.sections_mmap", case, folder,
                                   size], capture_output=True, text=True, cwd=root, env=env,
                                  check=True)
            results[case].append(json.loads(done.stdout.splitlines()[-1]))
    return results


def loads() -> list[tuple[str, AbstractContextManager]]:
    """The two conditions the section runs under."""
    return [("idle", idle), ("1 core busy", partial(busy_processes, 1))]


def median(results: list[dict], key: str) -> float:
    """The median of one figure over the rounds."""
    return float(np.median([result[key] for result in results]))


def case_rows(results: dict[str, list[dict]], condition: str) -> list[Row]:
    """The four rows of one condition: rates in distinct pages per second, and against the
    device the median of each round's ratio (the disk's rate drifts between rounds)."""
    rates = {case: np.array([r["pages"] / r["seconds"] for r in got])
             for case, got in results.items()}
    rate = {case: float(np.median(got)) for case, got in rates.items()}
    to_device = {case: float(np.median(got / rates["device"])) for case, got in rates.items()}
    pages = results["plain"][0]["pages"]
    resident = max(r["resident_before"] for got in results.values() for r in got)
    names = {
        "device": f"device: random 4 KiB O_DIRECT reads, queue depth {QUEUE_DEPTH}",
        "faults": "lookup, pages faulted one by one (the library's reads off)",
        "plain": "lookup (reads its cold pages itself)",
        "prefetch": "prefetch + lookup",
    }
    rows = []
    for case in CASES:
        notes = "the device's rate" if case == "device" else \
            f"{to_device[case]:.2f} of the device (paired)"
        if case == "plain":
            notes += (f"; warm lookups with / without the residency check (paired): "
                      f"{median(results['plain'], 'warm_ratio'):.3f} this batch, "
                      f"{median(results['plain'], 'warm_ratio_one'):.3f} one token")
        if case == "device":
            notes += f"; {pages:,} pages a batch; at most {resident:.1%} resident after eviction"
        rows.append(Row(case=f"{names[case]}, {condition}",
                        seconds=median(results[case], "seconds"),
                        rate=f"{rate[case] / 1e3:,.1f} k pages/s", condition=condition,
                        notes=notes))
    return rows


def bench_mmap_cold(quick: bool) -> Section:
    """Cold mapped-table lookups against the device's O_DIRECT rate, idle and one core busy."""
    size = "quick" if quick else "full"
    with tempfile.TemporaryDirectory() as folder:  # removed on errors and interrupts too
        nbytes = write_table(folder, size)
        print(f"mmap-cold: {nbytes / GIB:.2f} GiB table in {folder}", flush=True)
        tokens = SIZES[size][1]
        section = Section(
            f"cold mapped table (placement='mmap'), CPU: {nbytes / GIB:.2f} GiB fp8 checkpoint, "
            f"pages dropped (posix_fadvise DONTNEED), {tokens:,} tokens x 16 heads a batch; "
            f"fresh process per case, median of {SIZES[size][2]}", "cpu")
        for condition, load in loads():
            with load():
                results = run_cases(folder, size, SIZES[size][2])
            section.rows.extend(case_rows(results, condition))
    return section


if __name__ == "__main__":  # one case in this fresh process: JSON on the last line
    print(json.dumps(measure_case(sys.argv[1], sys.argv[2], sys.argv[3])))
