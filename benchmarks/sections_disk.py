"""Bench section ``disk``: lookups of a ``placement="disk"`` table twice the size of a memory cap.

The fp8 table is written once with ``save_ngram_embedding``; every case then runs in a fresh
process (``python -m benchmarks.sections_disk CASE FOLDER SIZE``) confined by a memory cgroup
(v1 at /sys/fs/cgroup/memory, or v2; the section is skipped with a note where none can be made)
whose limit is half the table (at least ``MIN_CAP``: the quick size's table is smaller than
twice that). Cases, each on one batch of the released layer's ids:

- ``device``: the device's own random 4 KiB read rate at queue depth 64: ``fio`` with io_uring
  where it is installed, else the library's own reader (Linux AIO) at its full depth;
- ``disk cold`` / ``disk warm``: a disk lookup with the files' pages dropped, then the same
  lookup again (its rows in the row cache);
- ``disk prefetch``: ``prefetch`` of the batch, a stand-in layer of about the cold lookup's time,
  then the lookup: the time the lookup waits. The layer leaves the host idle (as while a GPU
  runs it); ``disk prefetch-busy``'s keeps both cores busy with matmuls (a CPU layer);
- ``plain cold`` / ``plain warm``: the plain approach an engine takes (one
  ``posix_fadvise(WILLNEED)`` per run of pages, one ``os.preadv`` per distinct row, from
  Python), rows then gathered by the same CPU gather;
- ``mmap cold`` / ``mmap warm``: ``placement="mmap"``.

Each reports rows/s (ids looked up) and pages/s (distinct pages), and the process's peak RSS.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

import ngram_cupy as nc
from ngram_cupy.formats import storage_format
from ngram_cupy.memory.direct_reads import PAGE, AioContext, DirectFile, aligned_buffer
from ngram_cupy.tables.storage.cpu import CpuStorage
from ngram_cupy.tables.storage.disk import FILE_BITS

from .data import RELEASED, released_batch
from .report import Row, Section
from .sections_mmap import checkpoint_files, evict, write_table

GIB, MIB = 1 << 30, 1 << 20
CASES = ("device", "disk cold", "disk warm", "disk prefetch", "disk prefetch-busy",
         "plain cold", "plain warm", "mmap cold", "mmap warm")
SIZES = {  # ngram_vocab_size_base (table rows ~ 16x it), tokens per batch, rounds
    "quick": (100_000, 1024, 1),
    "full": (850_000, 4096, 5),
}
CGROUP_V1 = "/sys/fs/cgroup/memory"
MIN_CAP = 512 * MIB  # a case's process holds about 320 MiB itself (Python, NumPy, Numba, torch)


def config(size: str) -> nc.NGramConfig:
    """The released config with fewer rows: 0.24 GiB of fp8 rows (quick), 2.03 GiB (full)."""
    return dataclasses.replace(RELEASED, ngram_vocab_size_base=SIZES[size][0])


def make_cgroup(limit: int) -> str | None:
    """A memory cgroup limited to ``limit`` bytes (v1, else v2): the file its processes are
    written to, or None where none can be made."""
    for root, limit_file, procs in ((CGROUP_V1, "memory.limit_in_bytes", "cgroup.procs"),
                                    ("/sys/fs/cgroup", "memory.max", "cgroup.procs")):
        folder = os.path.join(root, f"ngram-cupy-disk-{os.getpid()}")
        try:
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, limit_file), "w") as f:
                f.write(str(limit))
            return os.path.join(folder, procs)
        except OSError:
            continue
    return None


def remove_cgroup(procs: str) -> None:
    """Remove the cgroup (its processes have ended)."""
    try:
        os.rmdir(os.path.dirname(procs))
    except OSError:
        pass


def batch_ids(size: str) -> np.ndarray:
    """One batch of the layer's ids: ``[tokens, 16]``."""
    layout = nc.layer_layout(config(size), 0)
    tokens, starts, context = released_batch(1, SIZES[size][1], seed=3)
    return nc.compute_ngram_ids(layout, tokens, starts, context)


def device_rate(files: list[str], seconds: float = 4.0) -> tuple[float, str]:
    """Random 4 KiB reads per second at queue depth 64 over ``files``, and what measured it."""
    fio = shutil.which("fio")
    if fio is not None:
        done = subprocess.run(
            [fio, "--name=rand", "--rw=randread", "--bs=4k", "--direct=1", "--iodepth=64",
             "--ioengine=io_uring", f"--runtime={seconds}", "--time_based", "--numjobs=1",
             "--group_reporting", "--output-format=json", f"--filename={':'.join(files)}"],
            capture_output=True, text=True)
        if done.returncode == 0:
            return float(json.loads(done.stdout)["jobs"][0]["read"]["iops"]), \
                "fio, io_uring, queue depth 64"
    opened = [DirectFile(path) for path in files]
    aio = AioContext(64)
    rng = np.random.default_rng(11)
    count = 200_000
    which = rng.integers(0, len(opened), count)
    pages = np.array([file.size // PAGE for file in opened])[which]
    offsets = (rng.random(count) * pages).astype(np.int64) * PAGE
    slots = 4096  # a ring of buffers, as fio reads into
    buffer = aligned_buffer(slots * PAGE)
    start = time.perf_counter()
    aio.read(opened, which, offsets, np.full(count, PAGE), buffer,
             np.arange(count) % slots * PAGE)
    rate = count / (time.perf_counter() - start)
    aio.close()
    return rate, "the library's reader (Linux AIO), queue depth 64 (no fio here)"


def plain_lookup(files: dict, blocks: list, ids: np.ndarray, head_dim: int, scale) -> np.ndarray:
    """The plain approach: WILLNEED per page run, one ``os.preadv`` per distinct row from
    Python, then the same CPU gather over the staged rows."""
    local = np.unique(ids.reshape(-1))
    staged = np.empty((local.size, head_dim), np.uint8)
    block = np.searchsorted(blocks[0], local, side="right") - 1
    offsets = blocks[2][block] + (local - blocks[0][block]) * head_dim
    keys = (blocks[1][block] << FILE_BITS) + offsets // PAGE
    pages = np.unique(np.concatenate([keys, (blocks[1][block] << FILE_BITS)
                                      + (offsets + head_dim - 1) // PAGE]))
    starts = pages[np.diff(pages, prepend=pages[0] - 2) != 1]
    ends = np.append(pages[np.flatnonzero(np.diff(pages) != 1)], pages[-1])
    for first, last in zip(starts.tolist(), ends.tolist(), strict=True):
        os.posix_fadvise(files[first >> FILE_BITS], (first & ((1 << FILE_BITS) - 1)) * PAGE,
                         (last - first + 1) * PAGE, os.POSIX_FADV_WILLNEED)
    for row, fd, offset in zip(range(local.size), blocks[1][block].tolist(), offsets.tolist(),
                               strict=True):
        os.preadv(files[fd], [staged[row]], offset)
    fp8 = storage_format("float8_e4m3fn")
    return nc.EmbeddingTable(CpuStorage(staged.view(fp8.dtype), fp8), scale).lookup(
        np.searchsorted(local, ids))


def measure_case(case: str, folder: str, size: str) -> dict:
    """In this fresh process (in the cgroup): one case; seconds, rows, pages, peak RSS."""
    ids = batch_ids(size)
    files = checkpoint_files(folder)
    placement = case.split()[0]
    result = {"rows": int(ids.size)}
    if placement == "device":
        result["rate"], result["how"] = device_rate(files)
        return result
    table = nc.load_ngram_embedding(folder, config(size), 0,
                                    placement="cpu" if placement == "plain" else placement,
                                    **({"cache_bytes": 64 * MIB} if placement == "disk"
                                       else {})).table if placement != "plain" else None
    probe = nc.load_ngram_embedding(folder, config(size), 0, placement="disk").table
    probe.lookup(ids)  # the distinct pages of the batch, counted by the disk reader
    result["pages"] = probe.cache_stats()["disk"]["pages"]
    probe.close()
    if placement == "plain":
        storage = nc.load_ngram_embedding(folder, config(size), 0, placement="disk").table
        blocks = (storage.storage.starts, storage.storage.row_file, storage.storage.offsets)
        fds = {i: os.open(file.path, os.O_RDONLY) for i, file in enumerate(
            storage.storage.files)}
        scale, head_dim = storage.scale, storage.head_dim

        def run() -> None:
            plain_lookup(fds, blocks, ids, head_dim, scale)
    else:
        run = lambda: table.lookup(ids)  # noqa: E731
        if placement == "disk":  # compiled, and its buffers grown, before timing
            run()
            table.storage.cache.resize(table.storage.cache.capacity)  # its rows cold again
        else:  # compiled (the pages of a mapped batch would stay mapped: one token's only)
            table.lookup(ids[:1])
    evict(files)
    if case.endswith("warm"):
        run()
    if "prefetch" in case:
        start = time.perf_counter()
        run()
        cold = time.perf_counter() - start
        table.storage.cache.resize(table.storage.cache.capacity)
        evict(files)
        side = np.ones((1024, 1024), np.float32)
        table.prefetch(ids)
        layer_start = time.perf_counter()
        if case.endswith("busy"):
            while time.perf_counter() - layer_start < cold:  # the stand-in layer, on the CPU
                side = side @ side * np.float32(1e-3)
        else:  # the host waits for the GPU
            time.sleep(cold)
        start = time.perf_counter()
        table.lookup(ids)
        result["seconds"] = time.perf_counter() - start
        result["cold"] = cold
    else:
        start = time.perf_counter()
        run()
        result["seconds"] = time.perf_counter() - start
    result["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return result


def run_cases(folder: str, size: str, procs: str, rounds: int) -> dict[str, list[dict]]:
    """Every case ``rounds`` times, in alternation, each in a fresh process in the cgroup."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [root, *filter(None, [os.environ.get("PYTHONPATH")])])}

    def join_cgroup() -> None:
        with open(procs, "w") as f:
            f.write(str(os.getpid()))

    results: dict[str, list[dict]] = {case: [] for case in CASES}
    for _ in range(rounds):
        for case in CASES:
            done = subprocess.run([sys.executable, "-m", "benchmarks.sections_disk", case,
                                   folder, size], capture_output=True, text=True, cwd=root,
                                  env=env, preexec_fn=join_cgroup)
            if done.returncode != 0:
                raise RuntimeError(f"disk bench case {case!r} failed:\n{done.stderr[-2000:]}")
            results[case].append(json.loads(done.stdout.splitlines()[-1]))
    return results


def case_rows(results: dict[str, list[dict]], cap: int) -> list[Row]:
    """One row per case: rows/s and pages/s; against the device, the plain approach and mmap
    the median of each round's ratio (the disk's rate drifts between rounds)."""
    median = {case: {key: float(np.median([r[key] for r in got]))
                     for key in got[0] if key != "how"} for case, got in results.items()}
    device = np.array([r["rate"] for r in results["device"]])

    def ratio(case: str, other: str | None = None) -> float:
        mine = np.array([r["pages"] / r["seconds"] for r in results[case]])
        if other is None:
            return float(np.median(mine / device))
        return float(np.median(mine / [r["pages"] / r["seconds"] for r in results[other]]))

    rows = [Row(case=f"device: random 4 KiB reads ({results['device'][0]['how']})",
                seconds=1 / median["device"]["rate"],
                rate=f"{median['device']['rate'] / 1e3:,.1f} k pages/s",
                notes="the device's rate, O_DIRECT")]
    for case in CASES[1:]:
        got = median[case]
        pages_rate, rows_rate = got["pages"] / got["seconds"], got["rows"] / got["seconds"]
        kind, state = case.split()
        notes = [f"{ratio(case):.2f}x the device"]
        for other in ("plain", "mmap"):
            if kind == "disk" and f"{other} {state}" in results:
                notes.append(f"{ratio(case, f'{other} {state}'):.2f}x {other} {state}")
        if state.startswith("prefetch"):
            notes = [f"lookup waits {got['seconds'] * 1e3:.1f} ms after a stand-in layer of "
                     f"{got['cold'] * 1e3:.1f} ms (the cold lookup's time)"]
        notes.append(f"peak RSS {got['peak_rss'] / MIB:,.0f} MiB (cap {cap / MIB:,.0f} MiB)")
        rows.append(Row(case=case, seconds=got["seconds"],
                        rate=f"{rows_rate / 1e3:,.0f} k rows/s, {pages_rate / 1e3:,.1f} k "
                             f"pages/s", notes="; ".join(notes)))
    return rows


def bench_disk(quick: bool) -> Section:
    """Disk-table lookups in a memory cgroup of half the table, against the device, the plain
    approach and mmap."""
    size = "quick" if quick else "full"
    with tempfile.TemporaryDirectory(dir=os.environ.get("NGRAM_CUPY_BENCH_DIR")) as folder:
        nbytes = write_table(folder, size, config(size))
        cap = max(nbytes // 2, MIN_CAP)
        load = os.getloadavg()
        section = Section(
            f"disk table (placement='disk'), CPU: {nbytes / GIB:.2f} GiB fp8 checkpoint in a "
            f"memory cgroup of {cap / MIB:,.0f} MiB, {SIZES[size][1]:,} tokens x 16 heads a "
            f"batch; fresh process per case, median of {SIZES[size][2]}; load average before "
            f"{load[0]:.1f}", "cpu")
        procs = make_cgroup(cap)
        if procs is None:
            section.title += " -- skipped: no memory cgroup can be made here"
            return section
        try:
            results = run_cases(folder, size, procs, SIZES[size][2])
        finally:
            remove_cgroup(procs)
        print("disk: " + json.dumps(results), flush=True)  # every round, for the record
        section.rows.extend(case_rows(results, cap))
        section.title += f", after {os.getloadavg()[0]:.1f}"
    return section


if __name__ == "__main__":  # one case in this fresh process: JSON on the last line
    print(json.dumps(measure_case(sys.argv[1], sys.argv[2], sys.argv[3])))
