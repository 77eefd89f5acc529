"""placement="disk": rows read per lookup from the checkpoint's files around the page cache,
bit-equal to placement="cpu" in every format, with exact row cache counters, clear errors for
changed files and failed reads, nothing left after close, and no page-cache growth."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import mmap
import os
import threading

import engram_cases
import ml_dtypes
import numpy as np
import pytest
import torch

import ngram_cupy as nc
from ngram_cupy.files.checkpoint_names import default_prefix, shard_key
from ngram_cupy.files.safetensors_files import Checkpoint
from ngram_cupy.formats import storage_format
from ngram_cupy.memory import direct_reads, page_reads
from ngram_cupy.tables.row_cache import RowCache
from ngram_cupy.tables.storage import disk as disk_storage

# 4 heads, 64 padded rows in 3 shards, head_dim 32: float32 rows of 128 bytes.
CONFIG = nc.NGramConfig(
    vocab_size=50, ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=11, eos_token_id=0,
    embedding_dim=128, make_ngram_vocab_size_divisible_by=8, split_ngram_parts=3,
)
ROWS, HEAD_DIM = 64, 32
FORMATS = ("float32", "bfloat16", "float8", "nvfp4")


def save(folder, name: str, seed: int = 0) -> None:
    """Layer 0 of ``CONFIG`` in format ``name``, in two files."""
    rng = np.random.default_rng(seed)
    values = rng.uniform(-4, 4, (ROWS, HEAD_DIM)).astype(np.float32)
    if name == "nvfp4":
        codes = rng.integers(0, 256, (ROWS, HEAD_DIM // 2), dtype=np.uint8)
        scales = rng.integers(0x30, 0x40, (ROWS, HEAD_DIM // 16), dtype=np.uint8)
        nc.save_ngram_embedding(folder, CONFIG, 0, codes, np.float32(0.5), num_files=2,
                                block_scales=scales.view(ml_dtypes.float8_e4m3fn))
        return
    dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16,
             "float8": ml_dtypes.float8_e4m3fn}[name]
    scale = np.array(0.375, ml_dtypes.bfloat16) if name == "float8" else None
    nc.save_ngram_embedding(folder, CONFIG, 0, values.astype(dtype), scale, num_files=2)


def load_layout():
    return nc.layer_layout(CONFIG, 0)


def load(folder, placement: str, **options):
    return nc.load_ngram_embedding(folder, CONFIG, 0, placement=placement, **options).table


def equal_bits(got, want) -> bool:
    return got.shape == want.shape and np.array_equal(np.asarray(got).view(np.uint8),
                                                      np.asarray(want).view(np.uint8))


@pytest.mark.parametrize("name", FORMATS)
def test_disk_rows_equal_cpu_rows_in_every_format(tmp_path, name, monkeypatch):
    """Lookups (repeated ids, rows sharing pages, a cache too small for them, another rank's
    shard, float32 output, rows read in chunks of 7) and a prefetch that a lookup of changed
    ids joins."""
    monkeypatch.setattr(disk_storage, "CHUNK_ROWS", 7)
    save(tmp_path / "m", name)
    cpu = load(tmp_path / "m", "cpu")
    ids = np.random.default_rng(1).integers(0, ROWS, (48, 4))
    changed = ids.copy()
    changed[::3, 2] = (changed[::3, 2] + 7) % ROWS
    for cache_bytes in (0, 1000):
        with load(tmp_path / "m", "disk", cache_bytes=cache_bytes) as disk:
            assert disk.placement == "disk" and not disk.storage.writable
            for asked in (ids, ids[::-1], np.arange(ROWS).reshape(-1, 4)):
                assert equal_bits(disk.lookup(asked), cpu.lookup(asked))
            assert equal_bits(disk.lookup(ids, out_dtype=np.float32),
                             cpu.lookup(ids, out_dtype=np.float32))
            disk.prefetch(ids)
            assert equal_bits(disk.lookup(changed), cpu.lookup(changed))
            torch_rows = disk.lookup(torch.from_numpy(ids), out_dtype=torch.float32)  # torch ids
            assert equal_bits(torch_rows.numpy(), cpu.lookup(ids, out_dtype=np.float32))
            with pytest.raises(IndexError, match=r"ids\[0, 1\] = 64"):
                disk.lookup(np.array([[0, ROWS]]))
    shard = nc.load_ngram_embedding(tmp_path / "m", CONFIG, 0, placement="disk", rank=1,
                                    world_size=2).table
    owned = (ids >= 32)[:, :, None].repeat(HEAD_DIM, 2).reshape(ids.shape[0], -1)
    want = np.where(owned, cpu.lookup(ids, out_dtype=np.float32), 0)
    assert equal_bits(shard.lookup(ids, out_dtype=np.float32), want)
    shard.close()


def test_mxfp8_engram_tables_on_disk_equal_cpu(tmp_path):
    """MXFP8 rows and their UE8M0 scales (two tensors) are read in one batch per lookup."""
    layout, _ = engram_cases.load_golden("synthetic")
    rng = np.random.default_rng(3)
    weights, scales = [], []
    for rows in layout.rows_per_layer:
        codes = rng.integers(0, 256, (rows, layout.head_dim), dtype=np.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0x38
        weights.append(codes.view(ml_dtypes.float8_e4m3fn))
        scales.append(rng.integers(100, 150, (rows, layout.head_dim // 32)).astype(np.uint8))
    nc.save_engram_embedding(tmp_path / "e", layout, weights, scales, num_files=2)
    cpu = nc.load_engram_embedding(tmp_path / "e", layout, placement="cpu")
    disk = nc.load_engram_embedding(tmp_path / "e", layout, placement="disk")
    for layer, rows in enumerate(layout.rows_per_layer):
        ids = rng.integers(0, rows, (16, layout.num_heads))
        assert equal_bits(disk.tables[layer].lookup(ids), cpu.tables[layer].lookup(ids))
        disk.tables[layer].close()


def test_cache_counters_are_exact_on_a_scripted_sequence(tmp_path):
    """float32 rows of 128 bytes; 3 rows of cache (one seeded hot row, two recent ones, LRU)."""
    save(tmp_path / "m", "float32")
    table = load(tmp_path / "m", "disk", cache_bytes=3 * 128, hot_rows=np.array([40]),
                 cache_policy="lru")
    info = Checkpoint.open(tmp_path / "m").info(shard_key(default_prefix(load_layout()), 0))
    page = direct_reads.PAGE

    def pages(rows):  # the pages rows of shard 0 (rows 0-21) touch
        return {(info.begin + r * 128 + edge) // page for r in rows for edge in (0, 127)}

    # (rows asked, rows read from disk): row 2 evicts 0 (used before 1), row 0 evicts 2
    script = [([0, 1], [0, 1]), ([1, 40], []), ([2, 2], [2]), ([0, 40, 1], [0])]
    for asked, _ in script:
        table.lookup(np.array([asked]))
    stats = table.cache_stats()
    assert stats["seeded"] == {"lookups": 8, "hits": 2, "misses": 6, "hit_rate": 2 / 8}
    assert stats["recent"] == {"lookups": 6, "hits": 2, "misses": 4, "hit_rate": 2 / 6}
    read = [pages(rows) for _, rows in script]
    runs = sum(sum(p - 1 not in touched for p in touched) for touched in read)
    disk_pages = sum(map(len, read))
    assert stats["disk"] == {"lookups": 4, "hits": 4, "misses": 0, "hit_rate": 1.0,
                             "reads": runs, "pages": disk_pages, "bytes": disk_pages * page}
    assert stats["overall"] == {"lookups": 4, "rows": 8, "hits": 4, "misses": 4,
                                "hit_rate": 0.5, "bytes_read": disk_pages * page,
                                "cached_rows": 3, "capacity_rows": 3}
    assert sorted(table.storage.cache.keys.tolist()) == [0, 1]
    table.close()


def test_a_cache_larger_than_the_table_holds_every_row_once(tmp_path):
    """cache_bytes past the table's bytes (a NumPy integer too): room for the rows not seeded,
    not for cache_bytes' worth of slots."""
    save(tmp_path / "m", "float32")
    table = load(tmp_path / "m", "disk", cache_bytes=np.int64(10**15), hot_rows=np.array([40]))
    table.lookup(np.arange(ROWS).reshape(-1, 4))
    overall = table.cache_stats()["overall"]
    assert overall["capacity_rows"] == overall["cached_rows"] == ROWS  # one of them seeded
    assert table.storage.cache.capacity == ROWS - 1
    table.close()


def test_each_policy_evicts_its_own_victim():
    """One row of room left, one row coming in: LRU drops the least recent, LFU the least used,
    CLOCK the first row after the hand whose bit is clear (bits cleared as it passes)."""
    victims = {}
    for policy in ("lru", "lfu", "clock"):
        cache = RowCache(1, 3, policy)
        out = np.zeros((4, 1), np.uint8)
        for rows in ([10, 11, 12], [10], [10], [11]):
            missed = cache.find(np.array(rows), out)
            cache.insert(np.array(rows)[missed], np.array(rows, np.uint8)[missed, None])
        cache.find(np.array([13]), out)
        cache.insert(np.array([13]), np.array([[13]], np.uint8))
        victims[policy] = sorted(set([10, 11, 12, 13]) - set(cache.keys.tolist()))
    assert victims == {"lru": [12], "lfu": [12], "clock": [10]}


def test_a_changed_or_truncated_file_is_an_oserror_naming_it(tmp_path, monkeypatch):
    for change in ("truncated", "replaced", "truncated unguarded"):
        folder = tmp_path / change.replace(" ", "_")
        save(folder, "float32")
        table = load(folder, "disk")
        ids = np.arange(ROWS).reshape(-1, 4)
        table.lookup(ids)
        path = sorted(folder.glob("*.safetensors"))[-1]
        if change == "replaced":
            copy = folder / "copy"
            copy.write_bytes(path.read_bytes())
            os.replace(copy, path)
        else:
            os.truncate(path, 200)
        if change.endswith("unguarded"):  # the read itself comes back short
            table.storage.guard = None
        with pytest.raises(OSError, match=f"{path.name}.*(shrank|replaced|ends at)"):
            table.lookup(ids)
        table.close()


def test_a_failed_read_is_an_oserror_naming_the_file(tmp_path, monkeypatch):
    save(tmp_path / "m", "bfloat16")
    table = load(tmp_path / "m", "disk")
    aio = table.storage.aio
    getevents = aio.getevents
    call = aio.call

    def failing(number, *args):
        count = call(number, *args)
        if number == getevents:
            aio.events["res"][:count] = -errno.EIO
        return count

    monkeypatch.setattr(aio, "call", failing)
    with pytest.raises(OSError, match="safetensors: reading .* Input/output error") as caught:
        table.lookup(np.array([[5, 6]]))
    assert caught.value.errno == errno.EIO
    monkeypatch.undo()
    table.storage.files[0].fd, fd = os.open(tmp_path, os.O_RDONLY), table.storage.files[0].fd
    os.close(fd)  # a descriptor the kernel refuses to read: named too
    with pytest.raises(OSError, match="safetensors: Invalid argument"):
        table.lookup(np.array([[5, 6]]))
    table.close()


def test_unaligned_tensors_and_filesystems_without_o_direct_read_the_same_rows(tmp_path,
                                                                            monkeypatch):
    """Tensors start wherever the header ends (not at a block boundary): the pages around them
    are read. A filesystem refusing O_DIRECT is read through the page cache (pages dropped
    after), and a table on tmpfs reads the same rows."""
    save(tmp_path / "m", "float8")
    cpu = load(tmp_path / "m", "cpu")
    ids = np.random.default_rng(2).integers(0, ROWS, (32, 4))
    begins = [info.begin for info in Checkpoint.open(tmp_path / "m").tensors.values()]
    assert any(begin % 512 for begin in begins)
    opened = os.open

    def no_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return opened(path, flags, *args)

    monkeypatch.setattr(direct_reads.os, "open", no_direct)
    table = load(tmp_path / "m", "disk")
    assert not any(file.direct for file in table.storage.files)
    assert equal_bits(table.lookup(ids), cpu.lookup(ids))
    table.close()
    monkeypatch.undo()
    if os.path.isdir("/dev/shm"):
        shm = os.path.join("/dev/shm", f"ngram-cupy-disk-{os.getpid()}")
        try:
            save(shm, "float8")
            table = load(shm, "disk")
            assert equal_bits(table.lookup(ids), cpu.lookup(ids))
            table.close()
        finally:
            for name in os.listdir(shm):
                os.remove(os.path.join(shm, name))
            os.rmdir(shm)


def test_close_releases_the_files_and_the_context(tmp_path):
    """After close, no descriptor of the process points at a checkpoint file (the direct
    reads' nor the guard's checkpoint's), and the row cache holds no memory."""
    import gc

    def checkpoint_fds() -> list[int]:
        fds = []
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/self/fd/{name}").startswith(str(tmp_path)):
                    fds.append(int(name))
        return fds

    save(tmp_path / "m", "bfloat16")
    table = load(tmp_path / "m", "disk", cache_bytes=4096, hot_rows=np.array([3, 4]))
    table.lookup(np.array([[1, 2]]))
    assert len(checkpoint_fds()) >= 2 * len(table.storage.files)  # the guard's and direct ones
    cache = table.storage.cache
    assert cache.seeded.nbytes and cache.records.nbytes
    table.close()
    gc.collect()
    assert checkpoint_fds() == []
    assert cache.seeded.nbytes == cache.records.nbytes == cache.slot_rows.nbytes == 0
    assert table.storage.aio.context.value == 0 and table.storage.buffer.size == direct_reads.PAGE
    with pytest.raises(ValueError, match="the table is closed"):
        table.storage.gather(None)


def test_a_disk_lookup_leaves_no_pages_in_the_page_cache(tmp_path):
    """mincore on the file after dropping its pages: the pages of the rows a disk lookup read
    stay out (a buffered read would bring them in). 8,000 rows of 128 bytes: 250 pages."""
    config = dataclasses.replace(CONFIG, ngram_vocab_size_base=2000)
    layout = nc.layer_layout(config, 0)
    path = tmp_path / "one.safetensors"
    nc.save_ngram_embedding(path, layout, np.ones((layout.padded_rows, HEAD_DIM), np.float32))
    table = nc.load_ngram_embedding(path, config, 0, placement="disk").table
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    size = os.fstat(fd).st_size
    mapping = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
    os.close(fd)
    view = np.frombuffer(mapping, np.uint8)
    pages = [view.ctypes.data + offset for offset in range(mmap.PAGESIZE, size, mmap.PAGESIZE)]
    assert len(pages) > 200
    resident = page_reads.resident_pages(pages)
    if resident is None or any(resident):
        pytest.skip("this file system keeps the file's pages or mincore is missing")
    ids = np.arange(layout.padded_rows).reshape(-1, 4)
    assert np.all(table.lookup(ids, out_dtype=np.float32) == 1)
    assert not any(page_reads.resident_pages(pages))
    assert table.cache_stats()["disk"]["pages"] >= len(pages)
    del view
    mapping.close()
    table.close()


class QueuedStream:
    """A stream that queues what is enqueued on it until ``run`` (or ``synchronize``); while
    ``capturing``, also into a graph that ``replay`` enqueues again."""

    def __init__(self, ptr: int = 0x2000):
        self.ptr, self.capturing, self.queued, self.graph = ptr, False, [], []

    def is_capturing(self) -> bool:
        return self.capturing

    def enqueue(self, step) -> None:
        self.queued.append(step)
        if self.capturing:
            self.graph.append(step)

    def launch_host_func(self, function, argument) -> None:
        """As CuPy's: one reference to ``(function, argument)`` taken at the launch and dropped
        by every run (a graph's second replay would use freed memory: here an IndexError)."""
        held = [(function, argument)]

        def run():
            function_, argument_ = held.pop()
            function_(argument_)
        self.enqueue(run)

    def replay(self) -> None:
        self.queued.extend(self.graph)

    def run(self) -> None:
        while self.queued:
            self.queued.pop(0)()

    synchronize = run


class QueuedDeviceArray:
    """A device array over host memory whose copies run in stream order."""

    def __init__(self, host: np.ndarray):
        self.host, self.shape, self.dtype = host, host.shape, host.dtype

    def get(self, stream, out, blocking=True):
        assert not blocking  # the host never waits for the stream
        stream.enqueue(lambda: out.__setitem__(..., self.host))
        return out

    def set(self, array, stream):
        stream.enqueue(lambda: self.host.__setitem__(..., array))


def test_gpu_ids_are_staged_in_stream_order_through_fixed_page_locked_buffers(tmp_path,
                                                                             monkeypatch):
    """Fake CuPy: the lookup enqueues the ids' copy, the host read and the rows' copy, and
    returns before any runs (a prefetch's reads overlap the caller's work); the rows equal a
    CPU table's, a joined prefetch regathers only the changed heads, buffers stay fixed per
    shape (a capture of a new shape is refused; the latest shapes are kept, and those a capture
    used), a captured lookup replays with each replay's
    ids (its host function lives on after a run), a failed read gives NaN bits and raises at the
    next lookup, and close releases the buffers."""
    from types import SimpleNamespace

    from ngram_cupy.runtime import host_functions
    from ngram_cupy.runtime.backends import DEVICE
    from ngram_cupy.tables import bad_ids
    from ngram_cupy.tables.storage import disk_staging
    from ngram_cupy.tables.storage.base import Gather

    monkeypatch.setattr(disk_staging, "cupy_module", lambda: SimpleNamespace(
        cuda=SimpleNamespace(alloc_pinned_memory=bytearray)))
    monkeypatch.setattr(host_functions, "launch_host_call", lambda stream, key: stream.enqueue(
        lambda: host_functions.run_host_call(key)))  # the driver's cuLaunchHostFunc
    calls = len(host_functions.CALLS)
    monkeypatch.setattr(bad_ids, "cupy_module", SimpleNamespace, raising=False)  # no GPU word
    save(tmp_path / "m", "float8")
    cpu = load(tmp_path / "m", "cpu")
    table = load(tmp_path / "m", "disk", cache_bytes=2048)
    storage, stream = table.storage, QueuedStream()
    ids = np.random.default_rng(4).integers(0, ROWS, (16, 4))
    want = cpu.lookup(ids)

    bf16 = storage_format(ml_dtypes.bfloat16)

    def gather(asked, out, expected=None):
        storage.gather(Gather(DEVICE, QueuedDeviceArray(asked), QueuedDeviceArray(out), bf16.code,
                              0, table.lookup_scale(bf16),
                              None if expected is None else QueuedDeviceArray(expected),
                              stream=stream, total_rows=ROWS))

    out = np.zeros(want.shape, np.uint16)
    gather(ids, out)
    assert len(stream.queued) == 3 and not out.any()  # nothing ran yet
    assert storage.cache_stats()["overall"]["lookups"] == 0
    stream.run()
    assert equal_bits(out, want)
    buffers = dict(storage.staging.buffers)
    changed = ids.copy()
    changed[::2, 1] = (changed[::2, 1] + 5) % ROWS
    before = storage.cache_stats()["overall"]["rows"]
    gather(changed, out, expected=ids)
    stream.run()
    assert equal_bits(out, cpu.lookup(changed))
    assert storage.cache_stats()["overall"]["rows"] - before == len(np.unique(changed[::2, 1]))
    assert storage.staging.buffers.keys() - buffers.keys() == {
        (stream.ptr, "expected", ids.shape, np.dtype(np.int64).str)}
    captured = ids.copy()
    stream.capturing = True
    gather(captured, out)  # a captured shape seen before: the same buffers
    with pytest.raises(RuntimeError, match="shape \\(8, 4\\) .* outside the capture first"):
        gather(ids[:8], out[:8])
    stream.capturing = False
    stream.run()
    kept = dict(storage.staging.kept)
    for size in range(1, 21):  # many batch sizes: only the latest shapes' buffers stay
        more = np.random.default_rng(size).integers(0, ROWS, (size, 4))
        rows = np.zeros((size, want.shape[1]), np.uint16)
        gather(more, rows)
        stream.run()
        assert equal_bits(rows, cpu.lookup(more))
    assert len(storage.staging.buffers) == disk_staging.KEPT
    assert storage.staging.kept == kept and len(kept) == 2  # the captured shape's ids and rows
    for replayed in (changed, ids):  # each replay reads its own ids' rows
        captured[...] = replayed
        stream.replay()
        stream.run()
        assert equal_bits(out, cpu.lookup(replayed))
    storage.guard = lambda: None
    storage.cache.resize(0)
    os.truncate(sorted((tmp_path / "m").glob("*.safetensors"))[-1], 300)
    gather(ids, out)
    stream.run()
    assert np.all(out == 0xFFFF)  # NaN bits
    with pytest.raises(OSError, match="truncated"):
        gather(ids, out)
    gather(ids, out)
    with pytest.raises(OSError, match="truncated"):
        table.check()  # waits for the stream, then raises
    gather(ids, out)
    stream.run()
    with pytest.raises(OSError, match="truncated"):
        table.lookup(ids[:0])  # a CPU lookup raises it too
    table.close()
    assert len(host_functions.CALLS) == calls  # the captured host call is let go
    assert storage.staging is None and storage.closed


def test_a_failed_read_leaves_no_completion_for_the_next_lookup(tmp_path, monkeypatch):
    """A read failing while others are in flight: the next lookup neither hangs nor takes the
    earlier batch's completions for its own."""
    save(tmp_path / "m", "float32")
    cpu, table = load(tmp_path / "m", "cpu"), load(tmp_path / "m", "disk", cache_bytes=0)
    aio, ids = table.storage.aio, np.arange(ROWS).reshape(-1, 4)
    call = aio.call
    monkeypatch.setattr(direct_reads, "MAX_RUN", direct_reads.PAGE)  # a read per page

    def one_failing(number, *args):  # one completion taken, and it failed
        if number != aio.getevents:
            return call(number, *args)
        count = call(number, 1, 1, *args[2:])
        aio.events["res"][:count] = -errno.EIO
        return count

    monkeypatch.setattr(aio, "call", one_failing)
    with pytest.raises(OSError, match="Input/output error"):
        table.lookup(ids)
    monkeypatch.setattr(aio, "call", call)
    asked = [ids[:1], ids, ids[-1:], ids]
    got = []
    reader = threading.Thread(target=lambda: got.extend(table.lookup(a) for a in asked),
                              daemon=True)
    reader.start()
    reader.join(timeout=60)
    assert len(got) == len(asked) and all(
        equal_bits(rows, cpu.lookup(a)) for rows, a in zip(got, asked, strict=True))
    table.close()


def test_no_ids_look_up_no_rows_on_disk_and_mapped_tables(tmp_path):
    """Ids of shape (0, H) or (B, 0, H), looked up or prefetched: empty rows, no error."""
    save(tmp_path / "m", "bfloat16")
    for placement in ("disk", "mmap"):
        table = load(tmp_path / "m", placement)
        for shape in ((0, 4), (2, 0, 4)):
            got = table.lookup(np.zeros(shape, np.int64))
            assert got.shape == (*shape[:-1], 4 * HEAD_DIM) and got.size == 0
        table.start_prefetch(np.zeros((0, 4), np.int64))
        assert table.lookup(np.zeros((0, 4), np.int64)).size == 0
        table.close()


def test_a_close_racing_lookups_gives_them_the_closed_table_error(tmp_path):
    """Lookups on other threads while the table closes: each one either returns the rows or
    raises the closed table's ValueError, never another error from released files."""
    save(tmp_path / "m", "float32")
    cpu, table = load(tmp_path / "m", "cpu"), load(tmp_path / "m", "disk", cache_bytes=0)
    ids = np.arange(ROWS).reshape(-1, 4)
    want, started, outcomes = cpu.lookup(ids), threading.Barrier(3), []

    def reader(asked):
        started.wait()
        while True:  # ends: every lookup after the close raises
            try:
                got = table.lookup(asked)
            except Exception as error:  # noqa: BLE001 (the outcome checked below)
                outcomes.append(error)
                return
            outcomes.append(equal_bits(got, want[:len(asked)]))

    readers = [threading.Thread(target=reader, args=(asked,), daemon=True)
               for asked in (ids, ids[:3])]
    for thread in readers:
        thread.start()
    started.wait()
    table.close()
    for thread in readers:
        thread.join(timeout=60)
    errors = [outcome for outcome in outcomes if not isinstance(outcome, bool)]
    assert len(errors) == 2 and all(
        isinstance(error, ValueError) and "the table is closed" in str(error) for error in errors)
    assert all(outcome for outcome in outcomes if isinstance(outcome, bool))
