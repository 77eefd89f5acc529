"""Table storages behind their one interface, and the ordering rules of fills and releases:
GPU fills end on the host (bug 2), pinned memory is released without a device-wide
synchronisation and never inside a capture (bug 5). CUDA streams are mocked here."""

from __future__ import annotations

import os
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

import ngram_cupy as nc
from ngram_cupy.codecs.dequant import reference_lookup
from ngram_cupy.formats import BFLOAT16, storage_format
from ngram_cupy.memory import pinned
from ngram_cupy.runtime.backends import DEVICE, HOST
from ngram_cupy.tables.storage import (
    PLACEMENTS,
    Gather,
    RowsSource,
    allocate,
    canonical_placement,
    find_placement,
    place,
    place_filled,
    placement_named,
)
from ngram_cupy.tables.storage import gpu as gpu_storage
from ngram_cupy.tables.storage.cpu import CpuStorage
from ngram_cupy.tables.storage.gpu import fill
from ngram_cupy.tables.storage.mapped import MappedStorage

FP8 = storage_format("float8_e4m3fn")


def random_fp8_rows(seed=0, count=40, head_dim=6):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((count, head_dim)) * 4).astype(ml_dtypes.float8_e4m3fn)


def gather_bf16(storage, ids, row_start=0, scale=0.5):
    out = np.empty((ids.shape[0], ids.shape[1] * storage.head_dim), np.uint16)
    storage.gather(Gather(HOST, ids, out, BFLOAT16, row_start, np.float32(scale)))
    return out.view(ml_dtypes.bfloat16)


@pytest.mark.parametrize("make", ["cpu", "pinned", "mapped"])
def test_every_host_storage_gathers_like_the_reference(make):
    weight = random_fp8_rows()
    if make == "mapped":
        storage = MappedStorage([(0, weight[:13]), (13, weight[13:])], 6, FP8)
    else:
        storage = allocate(make, 40, 6, FP8)
        storage.write_rows(0, weight[:25].view(np.uint8))
        storage.write_rows(25, weight[25:].view(np.uint8))
    assert storage.reads(HOST) and storage.num_rows == 40 and storage.format is FP8
    ids = np.random.default_rng(1).integers(95, 145, (17, 3))  # global rows 100..139 owned
    expected = reference_lookup(weight, ids - 100, 0.5, ml_dtypes.bfloat16)
    np.testing.assert_array_equal(gather_bf16(storage, ids, row_start=100).view(np.uint16),
                                  expected.view(np.uint16))


def test_placement_names():
    assert canonical_placement("host") == "pinned" == canonical_placement("pinned")
    with pytest.raises(ValueError, match="placement must be one of 'cpu', 'gpu', 'pinned'"):
        canonical_placement("disk")
    table = nc.EmbeddingTable(random_fp8_rows(), placement="host", scale=1.0)
    assert table.placement == "pinned"


def test_the_registry_knows_every_placement_and_what_it_is():
    assert tuple(PLACEMENTS) == ("cpu", "gpu", "pinned", "shared", "mmap")
    assert find_placement("host") is PLACEMENTS["pinned"] and find_placement("disk") is None
    assert find_placement(None) is None
    assert [name for name, p in PLACEMENTS.items() if p.private] == ["cpu", "gpu", "pinned"]
    assert PLACEMENTS["shared"].fills == "cpu" and PLACEMENTS["pinned"].fills == "pinned"
    assert placement_named("mmap", mapped=True).mapped
    with pytest.raises(ValueError, match=r"one of 'cpu', 'gpu', 'pinned', 'shared', 'host', got "
                                         r"'mmap' \('mmap' serves a checkpoint's rows"):
        placement_named("mmap")
    with pytest.raises(ValueError, match="one of 'cpu', 'gpu', 'pinned', 'shared', 'mmap', 'host'"):
        placement_named("disk", mapped=True)
    with pytest.raises(ValueError, match="weight: placement='shared' holds tables of one array"):
        PLACEMENTS["shared"].check_holds(storage_format("nvfp4"), "weight")
    PLACEMENTS["pinned"].check_holds(storage_format("nvfp4"))


def source_of(weight, key=None, mapped=True):
    """The rows of ``weight`` as a source of two blocks (and, with ``mapped``, two mapped ones)."""
    return RowsSource(weight.shape[0], weight.shape[1], FP8,
                      lambda: iter([(0, weight[:25], None), (25, weight[25:], None)]), key,
                      (lambda: [(0, weight[:13]), (13, weight[13:])]) if mapped else None)


@pytest.mark.parametrize("placement, kind", [
    ("cpu", "cpu"), ("host", "pinned"), ("mmap", "mmap"), ("shared", "shared")])
@pytest.mark.parametrize("keyed", [False, True])
def test_place_builds_the_storage_of_a_placement_from_its_source(placement, kind, keyed):
    weight = random_fp8_rows(seed=3)
    key = f"test_storage {placement} {keyed} {os.getpid()}" if keyed else None
    storage = place(placement, source_of(weight, key))
    assert storage.placement == kind and storage.num_rows == 40
    ids = np.random.default_rng(2).integers(0, 40, (9, 2))
    np.testing.assert_array_equal(gather_bf16(storage, ids).view(np.uint16),
                                  reference_lookup(weight, ids, 0.5, ml_dtypes.bfloat16)
                                  .view(np.uint16))
    assert storage.writable == (kind in ("cpu", "pinned"))
    assert (storage.shared_segment is not None) == (kind == "shared" and storage.segment.shared)
    storage.close()


def test_place_refuses_what_a_placement_cannot_hold():
    with pytest.raises(ValueError, match="placement must be one of .* got 'mmap'"):
        place("mmap", source_of(random_fp8_rows(), mapped=False))
    fmt = storage_format("nvfp4")
    packed = np.zeros((4, 8), np.uint8)
    source = RowsSource(4, 16, fmt, lambda: iter([(0, packed, np.zeros((4, 1), np.uint8))]))
    with pytest.raises(ValueError, match="placement='shared' holds tables of one array"):
        place("shared", source)
    assert place("cpu", source).host_scales.shape == (4, 1)


def test_place_filled_moves_filled_rows_into_the_segment_of_their_content():
    weight = random_fp8_rows(seed=4)
    filled = allocate(PLACEMENTS["shared"].fills, 40, 6, FP8)
    filled.write_rows(0, weight.view(np.uint8))
    shared = place_filled("shared", filled)
    assert shared.placement == "shared" and not shared.writable
    np.testing.assert_array_equal(shared.host_view.view(np.uint8), weight.view(np.uint8))
    assert place_filled("cpu", filled) is filled
    shared.close()


def test_every_storage_answers_the_optional_abilities():
    storage = allocate("cpu", 10, 4, storage_format("float32"))
    assert storage.cold is storage and storage.counters == {} and storage.device_tier is None
    assert not storage.page_locked and not storage.device_resident
    assert storage.shared_segment is None and storage.training_refusal() is None
    assert storage.training_rows().dtype == np.uint32
    storage.rows_changed(np.array([1]))
    storage.refresh_hot_rows()
    frozen = np.zeros((10, 4), np.float32)
    frozen.flags.writeable = False
    assert "read-only" in CpuStorage(frozen, storage_format("float32")).training_refusal()
    storage = MappedStorage([(0, random_fp8_rows())], 6, FP8)
    assert "'mmap' tables are read-only" in storage.training_refusal()
    table = nc.EmbeddingTable(np.zeros((10, 4), np.float32), hot_rows=[2, 5])
    assert table.storage.cold is not table.storage and table.storage.cold.placement == "cpu"
    assert table.counters == {"hot_rows": 0, "cold_rows": 0} and not table.pinned


def test_mapped_storage_is_read_only_and_cpu_only():
    storage = MappedStorage([(0, random_fp8_rows())], 6, FP8)
    assert storage.reads(HOST) and not storage.reads(DEVICE) and not storage.writable


class FakeStream:
    """A CuPy-like stream: records what happens, and whether it is capturing a graph."""

    def __init__(self, log, name, capturing=False, ptr=1):
        self.log, self.name, self.capturing, self.ptr = log, name, capturing, ptr

    def __enter__(self):
        self.log.append(f"enter {self.name}")
        return self

    def __exit__(self, *exc):
        self.log.append(f"exit {self.name}")

    def synchronize(self):
        self.log.append(f"synchronize {self.name}")

    def is_capturing(self):
        return self.capturing


class FakeDeviceRows:
    """Device rows that record the copies made into them (``contiguous``: else views into packed
    records, which CuPy's ``set`` refuses)."""

    def __init__(self, log, contiguous=True):
        self.log = log
        self.flags = SimpleNamespace(c_contiguous=contiguous)

    def set(self, block):
        self.log.append("copy from host")

    def __setitem__(self, index, block):
        self.log.append("copy on device")


@pytest.mark.parametrize("block, contiguous, copies", [
    (np.zeros((2, 3), np.uint8), True, ["copy from host"]),
    ("a device block", True, ["copy on device"]),
    (np.zeros((2, 3), np.uint8), False, ["upload", "copy on device"]),  # packed records
    ("a device block", False, ["copy on device"])])
def test_a_gpu_fill_is_finished_before_it_returns(monkeypatch, block, contiguous, copies):
    """Bug 2: a fill on CuPy's current stream, never waited for, could be read stale by a lookup
    on another stream or in a graph. The fill must copy on its stream and then wait for it."""
    log = []
    monkeypatch.setattr(gpu_storage, "DEVICE", SimpleNamespace(
        asarray=lambda block: log.append("upload") or block))
    fill(FakeDeviceRows(log, contiguous), block, FakeStream(log, "s"))
    assert log == ["enter s", *copies, "exit s", "synchronize s"]


def test_pinned_release_waits_for_its_streams_only_and_never_inside_a_capture(monkeypatch):
    """Bug 5: the release must not call cudaDeviceSynchronize (which breaks a global-mode
    capture): it waits for the streams that read the memory, and not while one captures."""
    log = []
    monkeypatch.setattr(pinned, "host_unregister", lambda pointer: log.append(f"unregister "
                                                                               f"{pointer}"))
    registration = pinned.Registration(0x1000, memory=object())
    caller, side = FakeStream(log, "caller", capturing=True, ptr=1), FakeStream(log, "side", ptr=2)
    registration.used_on(caller)
    registration.used_on(side)
    registration.used_on(caller)  # once per stream
    assert registration.release() is False and log == [] and not registration.released
    caller.capturing = False
    assert registration.release() is True and registration.released
    assert log == ["synchronize caller", "synchronize side", "unregister 4096"]
    assert registration.release() is True and len(log) == 3  # released once


def test_a_collected_pinned_buffer_is_released_later_without_cuda_calls(monkeypatch):
    """Garbage collection may run inside someone's graph capture: the finaliser only queues the
    registration; the queue drains at the next safe point."""
    log = []
    monkeypatch.setattr(pinned, "host_unregister", lambda pointer: log.append(pointer))
    monkeypatch.setattr(pinned, "_deferred", [])
    stream = FakeStream(log, "s", capturing=True)
    registration = pinned.Registration(0x2000, memory=object())
    registration.used_on(stream)
    pinned._collected(registration)  # what the finaliser does
    assert log == []
    assert pinned.release_deferred() == 1 and log == []  # still capturing: kept queued
    stream.capturing = False
    assert pinned.release_deferred() == 0 and log == ["synchronize s", 0x2000]


def test_one_failed_unregister_does_not_stop_the_other_releases(monkeypatch):
    """A registration whose cudaHostUnregister fails is dropped with a warning; the others
    queued with it are released, and the queue (which every new pinned buffer drains first)
    is empty, so later pinned allocations are not stopped by it."""
    log = []

    def unregister(pointer):
        if pointer == 0x2000:
            raise RuntimeError("cudaErrorHostMemoryNotRegistered")
        log.append(pointer)

    monkeypatch.setattr(pinned, "host_unregister", unregister)
    monkeypatch.setattr(pinned, "_deferred", [])
    for pointer in (0x1000, 0x2000, 0x3000):
        pinned._collected(pinned.Registration(pointer, memory=object()))
    with pytest.warns(RuntimeWarning, match="0x2000.*cudaErrorHostMemoryNotRegistered"):
        assert pinned.release_deferred() == 0
    assert log == [0x1000, 0x3000]
    assert pinned.release_deferred() == 0 and log == [0x1000, 0x3000]  # nothing left to fail


@pytest.mark.gpu
def test_a_failed_deferred_unregister_leaves_pinned_allocation_working(monkeypatch):
    """On a GPU: a queued registration CUDA refuses to unregister (never registered) must not
    make every later ``PinnedBuffer`` fail."""
    monkeypatch.setattr(pinned, "_deferred", [])
    never_registered = np.zeros(1 << 16, np.uint8)
    pinned._collected(pinned.Registration(never_registered.ctypes.data, never_registered))
    with pytest.warns(RuntimeWarning, match="could not unregister"):
        first = pinned.PinnedBuffer(1 << 20)
    assert first.registered and pinned._deferred == []
    first.close()
    second = pinned.PinnedBuffer(1 << 20)
    assert second.registered
    second.close()


class CheckingStream(FakeStream):
    """A stream whose wait checks the table still holds its old rows (nothing written yet)."""

    def __init__(self, log, name, table, old, capturing=False, ptr=1):
        super().__init__(log, name, capturing, ptr)
        self.table, self.old = table, old

    def synchronize(self):
        assert np.array_equal(self.table.host_view, self.old), "written before the wait"
        super().synchronize()


@pytest.mark.parametrize("hot_rows", [None, [1, 4]])
def test_writes_wait_for_the_lookups_still_reading_and_refuse_in_a_capture(hot_rows):
    """Bug: write_rows and refresh_hot_rows changed rows that GPU lookups queued on other
    streams may still read (a half-old, half-new result). They wait for those streams first
    (and only those), and refuse, writing nothing, while one of them captures a graph."""
    log = []
    weight = np.arange(24, dtype=np.float32).reshape(6, 4)
    table = nc.EmbeddingTable(weight.copy(), placement="pinned", hot_rows=hot_rows)
    old = table.host_view.copy()
    reader = CheckingStream(log, "reader", table, old, capturing=True)
    table.storage.used_on(reader)  # what a GPU lookup (or the fused kernel) reports
    with pytest.raises(RuntimeError, match="cannot write rows while a stream that looks up"):
        table.write_rows(2, np.ones((1, 4), np.float32))
    np.testing.assert_array_equal(table.host_view, old)
    reader.capturing = False
    table.write_rows(2, np.ones((1, 4), np.float32))
    assert log == ["synchronize reader"] and table.host_view[2].tolist() == [1, 1, 1, 1]
    table.write_rows(3, np.ones((1, 4), np.float32))  # no lookup since: no wait
    assert log == ["synchronize reader"]
    if hot_rows is not None:
        reader.old = table.host_view.copy()
        table.storage.used_on(reader)
        table.refresh_hot_rows()
        assert log == ["synchronize reader"] * 2


def test_close_waits_for_lookups_and_is_refused_during_a_capture():
    log = []
    table = nc.EmbeddingTable(np.zeros((6, 4), np.float32), placement="pinned")
    reader = FakeStream(log, "reader", capturing=True)
    table.storage.used_on(reader)
    with pytest.raises(RuntimeError, match="cannot close the table while a stream"):
        table.close()
    reader.capturing = False
    table.close()
    assert log[0] == "synchronize reader"


def test_a_gpu_tables_gather_reports_its_stream(monkeypatch):
    from ngram_cupy.tables.storage import gpu

    monkeypatch.setattr(gpu, "gather_device", lambda rows, code, job, scales=None: None)
    storage = gpu.GpuStorage(np.zeros((4, 2), np.uint32), storage_format("float32"))
    stream = FakeStream([], "lookup")
    storage.gather(Gather(DEVICE, None, None, 0, 0, np.float32(1), stream=stream))
    assert list(storage.readers.streams.values()) == [stream]


@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["pinned", "gpu"])
def test_a_write_never_changes_rows_under_a_running_lookup(placement):
    """On a device: a long lookup queued on a side stream, then at once a write of every row
    from the host; the lookup must read only the old rows."""
    import cupy

    rows = 1 << 14
    weight = np.zeros((rows, 64), np.float32)
    table = nc.EmbeddingTable(weight, placement=placement)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        ids = cupy.asarray(np.random.default_rng(2).integers(0, rows, (1 << 16, 16)))
    got = table.lookup(ids, stream=stream)  # ~256 MiB read: still running on return
    table.write_rows(0, np.ones((rows, 64), np.float32))
    stream.synchronize()
    assert not cupy.asnumpy(got).any()
