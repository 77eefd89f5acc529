"""placement="shared": one shared-memory segment per node, created by the first process and
attached by the others; its lifetime (kills included) and its bad inputs.

Every test keeps its segments in a directory of its own under /dev/shm (the same tmpfs, set
through NGRAM_CUPY_SHM_DIR, which spawned processes inherit) and checks that nothing is left
there afterwards.
"""

from __future__ import annotations

import errno
import fcntl
import multiprocessing
import os
import signal
import time
from dataclasses import asdict

import ml_dtypes
import numpy as np
import pytest

import ngram_cupy as nc
from ngram_cupy.tables import shared_memory as sm
from ngram_cupy.tables.dequant import reference_lookup

# 4 heads of sizes around 50,000: about 200,000 rows of 16 fp8 values (3.2 MB), in 4 shards.
CONFIG = nc.NGramConfig(
    vocab_size=50, ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=50_000,
    eos_token_id=0, embedding_dim=16, make_ngram_vocab_size_divisible_by=8, split_ngram_parts=4,
)
SCALE = np.array(0.375, dtype=ml_dtypes.bfloat16)
SPAWN = multiprocessing.get_context("spawn")
WAIT_S = 120


pytestmark = pytest.mark.usefixtures("shm_dir")  # conftest: nothing left in /dev/shm


@pytest.fixture(scope="module")
def weight():
    """The padded fp8 table of layer 0."""
    layout = nc.layer_layout(CONFIG, 0)
    values = np.random.default_rng(0).uniform(-4, 4, (layout.padded_rows, layout.head_dim))
    return values.astype(np.float32).astype(ml_dtypes.float8_e4m3fn)


@pytest.fixture
def checkpoint(tmp_path, weight):
    """The table saved as a checkpoint folder of two files."""
    folder = tmp_path / "model"
    nc.save_ngram_embedding(folder, CONFIG, 0, weight, SCALE, num_files=2)
    return folder


def ids(count=4096, seed=1):
    """Ids over the whole table and past both of its ends."""
    rows = nc.layer_layout(CONFIG, 0).padded_rows
    return np.random.default_rng(seed).integers(-3, rows + 3, (count, 4))


def expected(weight, lookup_ids):
    """The reference lookup, as bf16 bits."""
    return reference_lookup(weight, lookup_ids, np.float32(SCALE),
                            ml_dtypes.bfloat16).view(np.uint16)


def fill_with(value):
    """A fill writing ``value`` into every byte."""
    return lambda memory: np.frombuffer(memory, np.uint8).fill(value)


# --- one process ----------------------------------------------------------------------------


def test_attach_finds_the_segment_the_first_caller_filled(shm_dir):
    first = sm.attach("rows", 10_000, fill_with(7))
    second = sm.attach("rows", 10_000, fill_with(9))  # not called: the rows are there
    assert (first.created, second.created) == (True, False)
    assert first.path == second.path and first.path.parent == shm_dir
    assert np.all(np.frombuffer(second.memory, np.uint8) == 7)
    first.close()
    assert not first.attached and second.attached
    assert first.path.exists()  # second still holds it
    second.close()
    assert not first.path.exists()


def test_shared_table_equals_the_reference_and_is_read_only(weight, checkpoint, shm_dir):
    embedding = nc.load_ngram_embedding(checkpoint, CONFIG, 0, placement="shared")
    table = embedding.table
    assert table.placement == "shared" and table.storage.segment.created
    lookup_ids = ids()
    assert np.array_equal(table.lookup(lookup_ids).view(np.uint16), expected(weight, lookup_ids))
    with pytest.raises(ValueError, match="read-only"):
        table.write_rows(0, weight[:2])
    in_memory = nc.EmbeddingTable(weight, SCALE, placement="shared")  # content-named segment
    assert np.array_equal(in_memory.lookup(lookup_ids).view(np.uint16),
                          expected(weight, lookup_ids))
    assert len(sm.own_segments(shm_dir)) == 2
    table.close()
    in_memory.close()


def test_rows_of_another_rank_or_checkpoint_get_their_own_segment(weight, checkpoint, shm_dir):
    ranks = [nc.load_ngram_embedding(checkpoint, CONFIG, 0, placement="shared", rank=r,
                                     world_size=2).table for r in range(2)]
    assert len(sm.own_segments(shm_dir)) == 2
    time.sleep(0.01)
    os.utime(next(checkpoint.glob("*.safetensors")))  # a newer file: other rows, maybe
    changed = nc.load_ngram_embedding(checkpoint, CONFIG, 0, placement="shared").table
    assert changed.storage.segment.created and len(sm.own_segments(shm_dir)) == 3
    for table in (*ranks, changed):
        table.close()


def test_placement_shared_needs_rows_to_name_its_segment():
    with pytest.raises(ValueError, match="names its segment from the rows"):
        nc.EmbeddingTable.empty(10, 4, np.float32, placement="shared")


def test_a_fill_that_fails_leaves_no_segment(shm_dir):
    def broken(memory):
        raise RuntimeError("disk gone")

    with pytest.raises(RuntimeError, match="disk gone"):
        sm.attach("rows", 10_000, broken)
    assert os.listdir(shm_dir) == []
    sm.attach("rows", 10_000, fill_with(1)).close()  # the next caller creates it afresh


def test_too_little_shared_memory_is_refused_before_filling(shm_dir):
    free = sm.free_bytes(shm_dir)
    called = []
    with pytest.raises(OSError, match=f"needs {free + 1:,} bytes but .* has") as error:
        sm.attach("huge", free + 1, called.append)
    assert error.value.errno == errno.ENOSPC and "free" in str(error.value)
    assert not called and os.listdir(shm_dir) == []


def test_a_segment_of_the_same_name_with_other_contents_is_refused(shm_dir):
    path = shm_dir / sm.segment_name("rows")
    with open(path, "wb") as other:  # held by another user of the name, other rows
        other.write(sm.HEADER.pack(sm.MAGIC, 999, bytes(32)))
        other.flush()
        fcntl.flock(other.fileno(), fcntl.LOCK_SH)
        with pytest.raises(ValueError, match="in use but holds other contents"):
            sm.attach("rows", 10_000, fill_with(1))
        assert sm.HEADER.unpack(path.read_bytes()[: sm.HEADER.size])[1] == 999  # untouched
    os.unlink(path)
    os.unlink(f"{path}{sm.LOCK_SUFFIX}")


def test_permission_denied_names_the_file():
    with pytest.raises(PermissionError, match="no permission to open the shared-memory"):
        sm.attach("rows", 10_000, fill_with(1), directory="/sys")


def test_a_stale_half_filled_segment_is_filled_again(shm_dir):
    path = shm_dir / sm.segment_name("rows")
    path.write_bytes(b"\0" * 100)  # a killed creator's file: no magic, nobody holds it
    segment = sm.attach("rows", 10_000, fill_with(5))
    assert segment.created and np.all(np.frombuffer(segment.memory, np.uint8) == 5)
    segment.close()


def test_remove_stale_keeps_held_segments(shm_dir):
    held = sm.attach("held", 4096, fill_with(1))
    stale = shm_dir / sm.segment_name("stale")
    stale.write_bytes(b"x")
    assert sm.remove_stale(shm_dir) == [str(stale)]
    assert held.path.exists()
    held.close()


def test_resident_bytes_counts_this_process_mapping(shm_dir):
    segment = sm.attach("rows", 1 << 20, fill_with(3))
    rss, pss = sm.resident_bytes(segment.path)
    assert rss >= 1 << 20 and pss >= 1 << 20  # filled here, mapped by nobody else
    segment.close()


# --- several processes -----------------------------------------------------------------------


def start(job, barrier=None, event=None, results=None):
    """A spawned process running tests/shared_worker.py's ``run``."""
    import shared_worker

    process = SPAWN.Process(target=shared_worker.run, args=(job, barrier, event, results))
    process.start()
    return process


def job_for(checkpoint, tmp_path, index, lookup_ids, mode="normal"):
    return {"path": str(checkpoint), "config": asdict(CONFIG), "ids": lookup_ids,
            "out": str(tmp_path / f"out_{index}.npy"), "mode": mode}


def finish(processes):
    """Join every process; all must exit 0."""
    for process in processes:
        process.join(WAIT_S)
        if process.is_alive():
            process.kill()
        assert process.exitcode == 0


def test_four_processes_share_one_copy(weight, checkpoint, tmp_path, shm_dir):
    lookup_ids = ids()
    barrier, results = SPAWN.Barrier(4), SPAWN.Queue()
    processes = [start(job_for(checkpoint, tmp_path, i, lookup_ids), barrier, None, results)
                 for i in range(4)]
    reports = [results.get(timeout=WAIT_S) for _ in processes]
    finish(processes)
    table_bytes = weight.nbytes
    assert sum(created for created, *_ in reports) == 1
    assert all(rss >= table_bytes for *_, rss, _ in reports)  # each maps all of it
    assert sum(pss for *_, pss in reports) <= 1.5 * table_bytes  # ... but one copy in all
    want = expected(weight, lookup_ids)
    for i in range(4):
        assert np.array_equal(np.load(tmp_path / f"out_{i}.npy"), want)


def test_kills_during_and_after_the_fill_leave_nothing(weight, checkpoint, tmp_path, shm_dir):
    lookup_ids = ids(seed=2)
    in_fill, loaded, results = SPAWN.Event(), SPAWN.Event(), SPAWN.Queue()
    barrier = SPAWN.Barrier(4)  # the three that stay, and this test
    filler = start(job_for(checkpoint, tmp_path, 0, lookup_ids, "hang_in_fill"), None, in_fill,
                   results)
    assert in_fill.wait(WAIT_S)
    assert len(sm.own_segments(shm_dir)) == 1  # half filled, locked by its creator
    others = [start(job_for(checkpoint, tmp_path, i, lookup_ids), barrier, None, results)
              for i in (1, 2, 3)]
    killed_after = start(job_for(checkpoint, tmp_path, 4, lookup_ids, "hang_after"), None, loaded,
                         results)
    time.sleep(0.5)
    os.kill(filler.pid, signal.SIGKILL)  # mid-fill: the others must not take it as complete
    filler.join(WAIT_S)
    assert loaded.wait(WAIT_S)
    os.kill(killed_after.pid, signal.SIGKILL)  # attached, then killed: the others go on
    killed_after.join(WAIT_S)
    barrier.wait(WAIT_S)  # the others still hold the segment
    reports = [results.get(timeout=WAIT_S) for _ in others]
    barrier.wait(WAIT_S)
    finish(others)
    assert filler.exitcode == killed_after.exitcode == -signal.SIGKILL
    created = sum(report[0] for report in reports) + (not any(r[0] for r in reports))
    assert created == 1  # one process filled it again (or the one killed after, if first)
    want = expected(weight, lookup_ids)
    for i in (1, 2, 3, 4):
        assert np.array_equal(np.load(tmp_path / f"out_{i}.npy"), want)
    assert os.listdir(shm_dir) == []  # the last user removed it


def test_a_killed_last_user_leaves_a_segment_the_next_attach_removes(checkpoint, tmp_path,
                                                                      shm_dir):
    loaded, results = SPAWN.Event(), SPAWN.Queue()  # kept: the child opens them
    process = start(job_for(checkpoint, tmp_path, 0, ids(16), "hang_after"), None, loaded,
                    results)
    assert loaded.wait(WAIT_S)
    os.kill(process.pid, signal.SIGKILL)
    process.join(WAIT_S)
    assert len(sm.own_segments(shm_dir)) == 1  # nobody left to remove it
    sm.attach("another table", 4096, fill_with(1)).close()  # any next start cleans up
    assert os.listdir(shm_dir) == []


# --- on a GPU -------------------------------------------------------------------------------


@pytest.mark.gpu
def test_a_shared_table_is_page_locked_and_read_by_the_gpu(weight, checkpoint):
    import cupy

    table = nc.load_ngram_embedding(checkpoint, CONFIG, 0, placement="shared",
                                    hot_rows=np.arange(0, 5000, 7)).table
    assert table.pinned
    lookup_ids = ids(seed=5)
    want = expected(weight, lookup_ids)
    assert np.array_equal(cupy.asnumpy(table.lookup(cupy.asarray(lookup_ids))), want)
    table.prefetch(cupy.asarray(lookup_ids))
    assert np.array_equal(cupy.asnumpy(table.lookup(cupy.asarray(lookup_ids))), want)
    assert table.counters["hot_rows"] > 0
    table.close()


@pytest.mark.gpu
def test_mapped_tables_serve_gpu_ids_where_the_device_reads_pageable_memory(weight, checkpoint):
    import cupy

    from ngram_cupy.tables.storage import mapped

    table = nc.load_ngram_embedding(checkpoint, CONFIG, 0, placement="mmap").table
    lookup_ids = ids(seed=6)
    if not mapped.gpu_reads_pageable():
        with pytest.raises(ValueError, match="cudaDevAttrPageableMemoryAccess"):
            table.lookup(cupy.asarray(lookup_ids))
        return
    want = expected(weight, lookup_ids)  # two files: the merged per-block gathers
    assert np.array_equal(cupy.asnumpy(table.lookup(cupy.asarray(lookup_ids))), want)
    table.prefetch(cupy.asarray(lookup_ids))
    assert np.array_equal(cupy.asnumpy(table.lookup(cupy.asarray(lookup_ids))), want)
    table.close()
