"""placement="shared": one anonymous shared-memory segment per node, created by the first
process and attached by the others; its lifetime (kills included), fallback and bad inputs.

Every test names its segments in a scope of its own (NGRAM_CUPY_SHM_DIR, which child processes
inherit) and checks at the end that no process holds one: no rendezvous name bound, no
descriptor or mapping of the segment in any process (the kernel has freed its memory).
"""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import random
import selectors
import signal
import subprocess
import sys
import time
import warnings
from dataclasses import asdict
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from conftest import layer_rows

import ngram_cupy as nc
from ngram_cupy.codecs.dequant import reference_lookup
from ngram_cupy.memory import rendezvous
from ngram_cupy.memory import shared as sm

# 4 heads of sizes around 50,000: about 200,000 rows of 16 fp8 values (3.2 MB), in 4 shards.
CONFIG = nc.NGramConfig(
    vocab_size=50, ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=50_000,
    eos_token_id=0, embedding_dim=16, make_ngram_vocab_size_divisible_by=8, split_ngram_parts=4,
)
SCALE = np.array(0.375, dtype=ml_dtypes.bfloat16)
SPAWN = multiprocessing.get_context("spawn")
WAIT_S = 120
ATTACH_LIMIT_S = 10.0  # no attach may take longer, kills or not
WORKER = Path(__file__).with_name("segment_worker.py")
ROOT = Path(__file__).resolve().parents[2]


pytestmark = pytest.mark.usefixtures("shm_dir")  # conftest: nothing held at the end


@pytest.fixture(scope="module")
def fp8_layer():
    """The padded fp8 table of layer 0."""
    return layer_rows(CONFIG, ml_dtypes.float8_e4m3fn)


@pytest.fixture
def checkpoint(tmp_path, fp8_layer):
    """The table saved as a checkpoint folder of two files."""
    folder = tmp_path / "model"
    nc.save_ngram_embedding(folder, CONFIG, 0, fp8_layer, SCALE, num_files=2)
    return folder


def whole_table_ids(count=4096, seed=1):
    """Ids over the whole table, both ends included."""
    rows = nc.layer_layout(CONFIG, 0).padded_rows
    drawn = np.random.default_rng(seed).integers(0, rows, (count, 4))
    drawn[0, :2] = 0, rows - 1
    return drawn


def expected_bits(fp8_layer, lookup_ids):
    """The reference lookup, as bf16 bits."""
    return reference_lookup(fp8_layer, lookup_ids, np.float32(SCALE),
                            ml_dtypes.bfloat16).view(np.uint16)


def fill_with(value):
    """A fill writing ``value`` into every byte."""
    return lambda memory: np.frombuffer(memory, np.uint8).fill(value)


def descriptors(pid="self") -> list[tuple[int, str]]:
    """A process's open descriptors and what they name."""
    found = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            found.append((int(fd), os.readlink(f"/proc/{pid}/fd/{fd}")))
        except FileNotFoundError:  # closed meanwhile (the listing's own, say)
            pass
    return found


def segment_users(directory) -> list[int]:
    """Pids of the processes with a descriptor or a mapping of a segment of the scope."""
    wanted = "/memfd:" + sm.name_prefix(directory)
    users = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            links = [link for _, link in descriptors(pid)]
            with open(f"/proc/{pid}/maps") as maps:
                mapped = maps.read()
        except OSError:  # ended meanwhile, or not ours to read
            continue
        if wanted in mapped or any(link.startswith(wanted) for link in links):
            users.append(int(pid))
    return users


def assert_nothing_left(directory) -> None:
    """No name of the scope bound, no process holding or mapping one of its segments, and
    nothing written into the directory."""
    assert sm.own_segments(directory) == []
    assert segment_users(directory) == []
    assert os.listdir(directory) == []


# --- one process ----------------------------------------------------------------------------


def test_attach_finds_the_segment_the_first_caller_filled(shm_dir):
    first = sm.attach("rows", 10_000, fill_with(7))
    second = sm.attach("rows", 10_000, fill_with(9))  # not called: the rows are there
    assert (first.created, second.created) == (True, False)
    assert first.shared and first.name == second.name == sm.segment_name("rows", shm_dir)
    assert np.all(np.frombuffer(second.memory, np.uint8) == 7)
    np.frombuffer(first.memory, np.uint8)[3] = 1  # one memory, writable in every holder
    assert second.memory[3] == 1
    assert [pid for _, pid in sm.holders(first.name)] == [os.getpid()] * 2
    held = [fd for fd, link in descriptors() if link.startswith(first.path)]
    assert len(held) >= 2 and not any(map(os.get_inheritable, held))  # no program keeps it
    first.close()
    assert not first.attached and second.attached
    assert sm.own_segments(shm_dir) == [first.name]  # second still holds it
    second.close()
    assert sm.own_segments(shm_dir) == []
    del first, second
    assert segment_users(shm_dir) == []


def test_shared_table_equals_the_reference_and_is_read_only(fp8_layer, checkpoint, shm_dir):
    embedding = nc.load_ngram_embedding(checkpoint, CONFIG, 0, placement="shared")
    table = embedding.table
    assert table.placement == "shared" and table.storage.segment.created
    lookup_ids = whole_table_ids()
    assert np.array_equal(table.lookup(lookup_ids).view(np.uint16),
                          expected_bits(fp8_layer, lookup_ids))
    with pytest.raises(ValueError, match="read-only"):
        table.write_rows(0, fp8_layer[:2])
    in_memory = nc.EmbeddingTable(fp8_layer, SCALE, placement="shared")  # content-named segment
    assert np.array_equal(in_memory.lookup(lookup_ids).view(np.uint16),
                          expected_bits(fp8_layer, lookup_ids))
    assert len(sm.own_segments(shm_dir)) == 2
    table.close()
    in_memory.close()


def test_rows_of_another_rank_or_checkpoint_get_their_own_segment(fp8_layer, checkpoint, shm_dir):
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


@pytest.mark.parametrize("nbytes", [0, -1, 2.5, True])
def test_bad_sizes_and_timeouts_are_refused(nbytes):
    with pytest.raises(ValueError, match="nbytes must be a positive integer"):
        sm.attach("rows", nbytes, fill_with(1))
    with pytest.raises(ValueError, match="timeout must be a positive"):
        sm.attach("rows", 10, fill_with(1), timeout=0)


def test_a_fill_that_fails_leaves_no_segment(shm_dir):
    def broken(memory):
        raise RuntimeError("disk gone")

    with pytest.raises(RuntimeError, match="disk gone"):
        sm.attach("rows", 10_000, broken)
    assert_nothing_left(shm_dir)
    sm.attach("rows", 10_000, fill_with(1)).close()  # the next caller creates it afresh


def test_too_little_memory_falls_back_to_private_rows_or_refuses(fp8_layer, shm_dir, monkeypatch):
    monkeypatch.setattr(sm, "memory_available", lambda: 1_000)
    with pytest.warns(sm.SharedMemoryFallbackWarning,
                      match="needs 10,000 bytes but 1,000 bytes of memory are available"):
        private = sm.attach("rows", 10_000, fill_with(4))
    assert private.created and not private.shared and private.path is None
    assert np.all(np.frombuffer(private.memory, np.uint8) == 4)
    assert sm.own_segments(shm_dir) == []  # nobody else could attach to it
    private.close()
    called = []
    for strict, env in ((True, "0"), (None, "1")):
        monkeypatch.setenv(sm.STRICT_ENV, env)
        with pytest.raises(sm.SharedMemoryUnavailable, match="needs 10,000 bytes") as error:
            sm.attach("rows", 10_000, called.append, strict=strict)
        assert error.value.errno == errno.ENOSPC
    assert not called
    monkeypatch.setenv(sm.STRICT_ENV, "0")
    lookup_ids = whole_table_ids(64)
    with pytest.warns(sm.SharedMemoryFallbackWarning, match="private memory"):
        table = nc.EmbeddingTable(fp8_layer, SCALE, placement="shared")
    assert table.placement == "shared" and not table.storage.segment.shared
    assert np.array_equal(table.lookup(lookup_ids).view(np.uint16),
                          expected_bits(fp8_layer, lookup_ids))
    table.close()
    assert_nothing_left(shm_dir)


OVER_FILE_SIZE_LIMIT = """
import errno, json, resource, warnings
from ngram_cupy.memory import shared as sm
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    private = sm.attach("rows", 10_000, lambda memory: memory.write(bytes([5]) * 10_000))
try:
    sm.attach("rows", 10_000, print, strict=True)
except sm.SharedMemoryUnavailable as error:
    refused = [error.errno == errno.EFBIG, str(error)]
print(json.dumps({"shared": private.shared, "rows": private.memory[:] == bytes([5]) * 10_000,
                  "warned": [(w.category.__name__, str(w.message)) for w in caught],
                  "refused": refused}))
"""


def test_a_segment_over_the_file_size_limit_falls_back_or_refuses(shm_dir):
    """ftruncate of a memfd past RLIMIT_FSIZE fails with EFBIG: private rows with the warning,
    or SharedMemoryUnavailable when strict, never a bare OSError."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-S", "-c", OVER_FILE_SIZE_LIMIT], env=env,
                          capture_output=True, text=True, timeout=WAIT_S)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert not result["shared"] and result["rows"]
    [(category, message)] = result["warned"]
    assert category == "SharedMemoryFallbackWarning" and "10,000 bytes" in message, message
    assert "File too large" in message
    assert result["refused"][0] and "could not reserve 10,000 bytes" in result["refused"][1]


def test_memory_available_is_positive_and_at_most_the_node_memory():
    available = sm.memory_available()
    with open("/proc/meminfo") as meminfo:
        total = int(meminfo.readline().split()[1]) * 1024  # MemTotal
    assert available is not None and 0 < available <= total


def test_a_segment_of_the_same_name_with_other_contents_is_refused(shm_dir):
    name = sm.segment_name("rows", shm_dir)
    fd = os.memfd_create("other")
    os.ftruncate(fd, 999)
    sock = rendezvous.bind(f"{name}.{os.getpid()}.999")  # a holder of other rows
    server = rendezvous.Server(sock, sm.MESSAGE.pack(sm.MAGIC, 999, bytes(32)), fd)
    try:
        with pytest.raises(ValueError, match="in use but holds other contents"):
            sm.attach("rows", 10_000, fill_with(1))
    finally:
        server.close()
        os.close(fd)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a process as another user")
@pytest.mark.parametrize("holder", [False, True])
def test_a_name_bound_by_another_user_is_refused_naming_it(shm_dir, holder):
    name = sm.segment_name("rows", shm_dir) + (f".{os.getpid()}.999" if holder else "")
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # another user's process squatting the name
        os.setuid(65534)
        sock = rendezvous.bind(name)
        os.write(write, b"1")
        time.sleep(30)
        os._exit(0 if sock else 1)
    try:
        assert os.read(read, 1) == b"1"
        with pytest.raises(PermissionError, match=f"bound by process {child} of another user"):
            sm.attach("rows", 10_000, fill_with(1))
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        os.close(read)
        os.close(write)


def test_resident_bytes_counts_this_process_mapping(shm_dir):
    segment = sm.attach("rows", 1 << 20, fill_with(3))
    rss, pss = sm.resident_bytes(segment.path)
    assert rss >= 1 << 20 and pss >= 1 << 20  # filled here, mapped by nobody else
    segment.close()


def test_a_forked_child_neither_serves_nor_keeps_the_segment(shm_dir):
    segment = sm.attach("rows", 4096, fill_with(2))
    read, write = os.pipe()
    ready_read, ready_write = os.pipe()
    child = os.fork()
    if child == 0:  # holds a copy of the mapping, no descriptor, no name
        os.close(write)
        os.write(ready_write, b"1")  # the fork hooks have run
        os.read(read, 1)
        os._exit(0)
    os.close(read)
    try:
        assert os.read(ready_read, 1) == b"1"
        assert [pid for _, pid in sm.holders(segment.name)] == [os.getpid()]
        segment.close()
        assert sm.own_segments(shm_dir) == []  # the child's copy of the name was closed
    finally:
        for fd in (write, ready_read, ready_write):
            os.close(fd)
        os.waitpid(child, 0)


def test_a_child_forked_during_the_fill_keeps_no_name(shm_dir):
    """A child forked while the creator fills (by another thread, a worker pool...) closes its
    copies of the sockets: the names go with the processes that bound them, so a later
    process is never left waiting on a name nobody answers (issue 43)."""
    release_read, release_write = os.pipe()
    forked_read, forked_write = os.pipe()
    children = []

    def fill_and_fork(memory):
        child = os.fork()
        if child == 0:  # lives on, holding whatever it inherited, until released
            os.write(forked_write, b"1")  # its fork hooks have run (it may start late)
            os.close(release_write)
            os.read(release_read, 1)
            os._exit(0)
        children.append(child)
        assert os.read(forked_read, 1) == b"1"
        memory[:] = bytes([6]) * len(memory)

    try:
        segment = sm.attach("rows", 4096, fill_and_fork)
        assert segment.created and len(children) == 1
        segment.close()
        assert sm.own_segments(shm_dir) == []  # neither the creation name nor a holder's
    finally:
        os.close(release_write)
        for child in children:
            os.waitpid(child, 0)
        os.close(release_read)
        os.close(forked_read)
        os.close(forked_write)


def test_a_creation_name_outliving_its_creator_is_an_error_naming_it(shm_dir):
    """A copy of a creation name's socket that the fork hooks never saw (a fork from C code)
    outlives its creator: the waiter names the dead creator instead of waiting forever."""
    release_read, release_write = os.pipe()
    creator = os.fork()
    if creator == 0:  # binds the name, leaves a copy in a child, ends mid-fill
        sock = rendezvous.bind(sm.segment_name("rows", shm_dir))
        rendezvous.SOCKETS.discard(sock)
        os.close(release_write)
        if os.fork() == 0:
            os.read(release_read, 1)
            os._exit(0)
        os._exit(0)
    try:
        os.waitpid(creator, 0)
        began = time.monotonic()
        with pytest.raises(TimeoutError, match=f"process {creator}, which bound .* is gone"):
            sm.attach("rows", 4096, fill_with(1), timeout=ATTACH_LIMIT_S)
        assert time.monotonic() - began < ATTACH_LIMIT_S / 2
    finally:
        os.close(release_write)
        os.close(release_read)
    while sm.own_segments(shm_dir):  # the child saw its pipe close and ends
        time.sleep(0.01)


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


def test_four_processes_share_one_copy(fp8_layer, checkpoint, tmp_path, shm_dir):
    lookup_ids = whole_table_ids()
    barrier, results = SPAWN.Barrier(4), SPAWN.Queue()
    processes = [start(job_for(checkpoint, tmp_path, i, lookup_ids), barrier, None, results)
                 for i in range(4)]
    reports = [results.get(timeout=WAIT_S) for _ in processes]
    finish(processes)
    table_bytes = fp8_layer.nbytes
    assert sum(created for created, *_ in reports) == 1
    assert all(rss >= table_bytes for *_, rss, _ in reports)  # each maps all of it
    assert sum(pss for *_, pss in reports) <= 1.5 * table_bytes  # ... but one copy in all
    want = expected_bits(fp8_layer, lookup_ids)
    for i in range(4):
        assert np.array_equal(np.load(tmp_path / f"out_{i}.npy"), want)


def test_kills_during_and_after_the_fill_leave_nothing(fp8_layer, checkpoint, tmp_path, shm_dir):
    lookup_ids = whole_table_ids(seed=2)
    in_fill, loaded, results = SPAWN.Event(), SPAWN.Event(), SPAWN.Queue()
    barrier = SPAWN.Barrier(4)  # the three that stay, and this test
    filler = start(job_for(checkpoint, tmp_path, 0, lookup_ids, "hang_in_fill"), None, in_fill,
                   results)
    assert in_fill.wait(WAIT_S)
    assert len(sm.own_segments(shm_dir)) == 1  # half filled: its creation name is bound
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
    want = expected_bits(fp8_layer, lookup_ids)
    for i in (1, 2, 3, 4):
        assert np.array_equal(np.load(tmp_path / f"out_{i}.npy"), want)
    assert_nothing_left(shm_dir)  # the kernel freed it with its last user


def test_a_killed_last_user_of_a_deleted_checkpoint_leaves_nothing(checkpoint, tmp_path,
                                                                   shm_dir):
    loaded, results = SPAWN.Event(), SPAWN.Queue()  # kept: the child opens them
    process = start(job_for(checkpoint, tmp_path, 0, whole_table_ids(16), "hang_after"), None,
                    loaded, results)
    assert loaded.wait(WAIT_S)
    assert len(sm.own_segments(shm_dir)) == 1 and segment_users(shm_dir) == [process.pid]
    os.kill(process.pid, signal.SIGKILL)
    process.join(WAIT_S)
    for file in checkpoint.iterdir():  # nobody will ever name these rows again
        file.unlink()
    checkpoint.rmdir()
    assert_nothing_left(shm_dir)  # no later attach needed: the kernel freed it


# --- many small processes (tests/segment_worker.py imports only shared_memory) -------------


NBYTES = 1 << 20


def worker(key, mode="attach", delay=0.0, timeout=ATTACH_LIMIT_S):
    """A started tests/segment_worker.py, its stdin and stdout pipes open."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")])}
    return subprocess.Popen(
        [sys.executable, "-S", str(WORKER), key, str(NBYTES), mode, str(timeout), str(delay)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)


def report(process, wait=2 * ATTACH_LIMIT_S):
    """The JSON line a worker printed (None when it ended without one)."""
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        if not selector.select(wait):
            raise AssertionError(f"worker {process.pid} printed nothing within {wait} s")
    line = process.stdout.readline()
    return json.loads(line) if line else None


def kill(process):
    """SIGKILL a worker and reap it (its descriptors and names go with it)."""
    process.kill()
    process.wait(WAIT_S)
    process.stdout.close()
    process.stdin.close()


def pattern_fill(memory):
    """The fill of tests/segment_worker.py."""
    memory[:] = (bytes(range(251)) * (NBYTES // 251 + 1))[:NBYTES]


def test_the_last_user_killed_leaves_nothing(shm_dir):
    first = worker("table")
    assert report(first)["created"]
    second = worker("table")
    joined = report(second)
    assert not joined["created"] and joined["complete"]
    first.stdin.close()  # the creator detaches and ends normally
    assert first.wait(WAIT_S) == 0
    assert sm.own_segments(shm_dir) and segment_users(shm_dir) == [second.pid]
    kill(second)
    first.stdout.close()
    assert_nothing_left(shm_dir)


def test_every_user_killed_leaves_nothing(shm_dir):
    processes = [worker("table") for _ in range(3)]
    reports = [report(process) for process in processes]
    assert sum(r["created"] for r in reports) == 1 and all(r["complete"] for r in reports)
    assert sorted(segment_users(shm_dir)) == sorted(p.pid for p in processes)
    for process in processes:
        kill(process)
    assert_nothing_left(shm_dir)


def test_attach_never_waits_on_a_dead_creator_and_names_a_live_one(shm_dir):
    creator = worker("table", "hang_in_fill")
    assert report(creator)["filling"]
    began = time.monotonic()
    with pytest.raises(TimeoutError, match=f"waited 0.3 s for process {creator.pid} to fill"):
        sm.attach("table", NBYTES, pattern_fill, timeout=0.3)
    kill(creator)  # mid-fill: its half-filled segment is gone with it
    segment = sm.attach("table", NBYTES, pattern_fill, timeout=ATTACH_LIMIT_S)
    assert segment.created and time.monotonic() - began < ATTACH_LIMIT_S
    segment.close()
    del segment
    assert_nothing_left(shm_dir)


def test_a_stopped_holder_is_named_not_waited_on(shm_dir, monkeypatch):
    monkeypatch.setattr(sm, "HANDOVER_SECONDS", 0.3)
    holder = worker("table")
    assert report(holder)["created"]
    os.kill(holder.pid, signal.SIGSTOP)
    try:
        while any(open(f"/proc/{holder.pid}/task/{task}/stat").read().split(") ")[1][0] != "T"
                  for task in os.listdir(f"/proc/{holder.pid}/task")):
            time.sleep(0.001)  # every thread stopped (the signal is asynchronous)
        with pytest.raises(TimeoutError, match=f"process.es. {holder.pid} hold .* did not hand"):
            sm.attach("table", NBYTES, pattern_fill)
    finally:
        kill(holder)
    assert_nothing_left(shm_dir)


def test_twenty_rounds_of_a_four_process_kill_race_leave_nothing(shm_dir):
    """Four processes attach one segment (the creator's fill lasts 0.1 s); one to four of them
    are killed, each at a random moment (starting, waiting, filling) or once attached. The
    others and a process starting afterwards attach well within the limit, to the whole rows;
    once the rest are killed nothing is left."""
    rng = random.Random(31)
    want = (bytes(range(251)) * (NBYTES // 251 + 1))[:NBYTES]
    killed_attached = 0
    for round_ in range(20):
        key = f"race {round_}"
        processes = [worker(key, delay=0.1) for _ in range(4)]
        victims = rng.sample(processes, rng.randint(1, 4))
        for victim in victims:
            if rng.random() < 0.25:  # once attached (maybe the creator: the others go on)
                attached = report(victim)
                assert attached["complete"] and attached["seconds"] < ATTACH_LIMIT_S
                killed_attached += 1
            else:
                time.sleep(rng.uniform(0, 0.15))
            kill(victim)
        survivors = [p for p in processes if p not in victims]
        for process in survivors:
            attached = report(process)
            assert attached["complete"] and attached["seconds"] < ATTACH_LIMIT_S, (round_,
                                                                                   attached)
        began = time.monotonic()  # a process starting now attaches at once, or fills afresh
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            segment = sm.attach(key, NBYTES, pattern_fill, timeout=ATTACH_LIMIT_S)
        assert time.monotonic() - began < ATTACH_LIMIT_S
        assert segment.memory[:] == want and segment.created == (not survivors), round_
        segment.close()
        del segment
        for process in survivors:
            kill(process)
        assert_nothing_left(shm_dir)
    assert killed_attached > 0


SOAK_WORKER = Path(__file__).with_name("soak_worker.py")
SOAK_ROUNDS = 50


def soak_process(mode, key, seed=0):
    """A started tests/memory/soak_worker.py (``slot`` or ``churn``), its pipes open and
    unbuffered (a line read takes no byte of the next: ``report`` selects on the pipe)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")])}
    return subprocess.Popen(
        [sys.executable, "-S", str(SOAK_WORKER), mode, key, str(1 << 16), str(seed)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, bufsize=0)


def test_fifty_rounds_of_four_attaches_and_a_kill_all_answer_in_time(shm_dir):
    """Fifty rounds, at once one after the other, of one table: four processes attach it (no
    timeout), one of them is SIGKILLed, the others detach and end; meanwhile other processes
    attach it and are SIGKILLed at random moments (waiting, filling, handing over), some after
    forking a process that outlives them. Every attach answers within its bound, with the whole
    rows, and nothing is left."""
    rng = random.Random(43)
    slots = [soak_process("slot", "soak") for _ in range(4)]
    churn = soak_process("churn", "soak", seed=43)
    try:
        ending = False  # the last round's children may still be ending
        for round_ in range(SOAK_ROUNDS):
            for process in slots:
                process.stdin.write(b"attach\n")
            for process in slots:
                if ending:
                    assert "ended" in report(process, ATTACH_LIMIT_S)
                attached = report(process, ATTACH_LIMIT_S)
                assert attached.get("complete") and attached["seconds"] < ATTACH_LIMIT_S, (
                    round_, attached)
            victim = rng.randrange(4)
            for index, process in enumerate(slots):
                process.stdin.write(b"kill\n" if index == victim else b"end\n")
            ending = round_ % 2 == 0  # else the next round begins once no slot holds it
            for process in slots if not ending else ():
                assert "ended" in report(process, ATTACH_LIMIT_S)
        churn.stdin.close()
        lines = [json.loads(line) for line in churn.stdout]
        assert churn.wait(WAIT_S) == 0
        assert lines[-1]["late"] == [] and lines[-1]["killed"] > 0, lines
        assert all("error" not in line for line in lines), lines
    finally:
        for process in [*slots, churn]:
            for pipe in (process.stdin, process.stdout):
                try:
                    pipe.close()
                except (BrokenPipeError, ValueError):
                    pass
            if process.wait(WAIT_S) != 0:
                process.kill()
    began = time.monotonic()  # the processes forked in fills saw their pipe close and end
    while segment_users(shm_dir) and time.monotonic() - began < ATTACH_LIMIT_S:
        time.sleep(0.01)
    assert_nothing_left(shm_dir)


# --- on a GPU -------------------------------------------------------------------------------


@pytest.mark.gpu
def test_a_shared_table_is_page_locked_and_read_by_the_gpu(fp8_layer, checkpoint):
    import cupy

    table = nc.load_ngram_embedding(checkpoint, CONFIG, 0, placement="shared",
                                    hot_rows=np.arange(0, 5000, 7)).table
    assert table.pinned
    lookup_ids = whole_table_ids(seed=5)
    want = expected_bits(fp8_layer, lookup_ids)
    assert np.array_equal(cupy.asnumpy(table.lookup(cupy.asarray(lookup_ids))), want)
    table.prefetch(cupy.asarray(lookup_ids))
    assert np.array_equal(cupy.asnumpy(table.lookup(cupy.asarray(lookup_ids))), want)
    assert table.counters["hot_rows"] > 0
    table.close()


@pytest.mark.gpu
def test_mapped_tables_serve_gpu_ids_where_the_device_reads_pageable_memory(fp8_layer, checkpoint):
    import cupy

    from ngram_cupy.tables.storage import mapped

    table = nc.load_ngram_embedding(checkpoint, CONFIG, 0, placement="mmap").table
    lookup_ids = whole_table_ids(seed=6)
    if not mapped.gpu_reads_pageable():
        with pytest.raises(ValueError, match="cudaDevAttrPageableMemoryAccess"):
            table.lookup(cupy.asarray(lookup_ids))
        return
    want = expected_bits(fp8_layer, lookup_ids)  # two files: the merged per-block gathers
    assert np.array_equal(cupy.asnumpy(table.lookup(cupy.asarray(lookup_ids))), want)
    table.prefetch(cupy.asarray(lookup_ids))
    assert np.array_equal(cupy.asnumpy(table.lookup(cupy.asarray(lookup_ids))), want)
    table.close()
