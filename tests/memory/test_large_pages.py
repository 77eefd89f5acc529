"""Pinned tables in large GPU pages (``memory.large_pages``): the choice, what the driver is
asked for, when the mapping goes, and the fallback to registered memory with a warning; on the
CPU, with the fake CuPy and a stand-in for ``cuda.bindings.driver``."""

from __future__ import annotations

import ctypes
import gc
import mmap
import types

import numpy as np
import pytest
from fake_cupy import DeviceArray, install_fake_cupy

import ngram_cupy as nc
from ngram_cupy.memory import large_pages, pinned
from ngram_cupy.tables import gather_cupy

GRANULARITY = 2 << 20


class FakeDriver:
    """The driver calls ``LargePageBuffer`` makes, logged; ``supported`` and ``failing`` (a
    call's name) decide what it refuses. Reserved ranges are real anonymous memory."""

    CUresult = types.SimpleNamespace(CUDA_SUCCESS=0)
    CUdevice_attribute = types.SimpleNamespace(
        CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED="host numa vmm",
        CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID="host numa id")
    CUmemAllocationType = types.SimpleNamespace(CU_MEM_ALLOCATION_TYPE_PINNED="pinned")
    CUmemLocationType = types.SimpleNamespace(CU_MEM_LOCATION_TYPE_DEVICE="device",
                                              CU_MEM_LOCATION_TYPE_HOST_NUMA="host numa")
    CUmemAllocationGranularity_flags = types.SimpleNamespace(
        CU_MEM_ALLOC_GRANULARITY_RECOMMENDED="recommended")
    CUmemAccess_flags = types.SimpleNamespace(CU_MEM_ACCESS_FLAGS_PROT_READWRITE="rw")

    def __init__(self, supported=1, failing=None, gpus=2):
        self.supported, self.failing, self.calls, self.ranges = supported, failing, [], {}
        self.gpus = gpus  # the process's GPUs; ``supported`` may list those mapping host NUMA

        def located():
            return types.SimpleNamespace(type=None, location=types.SimpleNamespace(
                type=None, id=None), flags=None)

        self.CUmemAllocationProp = self.CUmemAccessDesc = located

    def __getattr__(self, name):
        if not name.startswith("cuMem") and name not in ("cuDeviceGetAttribute",
                                                         "cuDeviceGetCount"):
            raise AttributeError(name)

        def call(*args):
            self.calls.append((name, *args))
            if name == self.failing:
                return (1,)
            return (0, *getattr(self, "answer_" + name, lambda *a: ())(*args))

        return call

    def answer_cuDeviceGetAttribute(self, attribute, device):
        supported = self.supported if isinstance(self.supported, int) else \
            int(device in self.supported)
        return (supported if attribute == "host numa vmm" else 1,)

    def answer_cuDeviceGetCount(self):
        return (self.gpus,)

    def answer_cuMemGetAllocationGranularity(self, prop, option):
        return (GRANULARITY,)

    def answer_cuMemCreate(self, size, prop, flags):
        return (("handle", size),)

    def answer_cuMemAddressReserve(self, size, alignment, address, flags):
        memory = mmap.mmap(-1, size)
        pointer = ctypes.addressof(ctypes.c_char.from_buffer(memory))
        self.ranges[pointer] = memory
        return (pointer,)

    def named(self, name):
        return [call for call in self.calls if call[0] == name]


@pytest.fixture
def silent_gpu(monkeypatch):
    cupy = install_fake_cupy(monkeypatch)
    monkeypatch.setattr(gather_cupy, "_kernel", lambda name, device: lambda *args, **kw: None)
    return cupy


def test_large_gpu_pages_are_a_choice_of_pinned_tables(silent_gpu, monkeypatch):
    fake = FakeDriver()
    monkeypatch.setattr(large_pages, "driver", lambda: fake)
    monkeypatch.setenv(large_pages.GPU_PAGES_ENV, "large")
    weight = np.random.default_rng(0).standard_normal((1000, 8)).astype(np.float32)
    table = nc.EmbeddingTable(weight, placement="pinned")
    buffer = table.storage.buffer
    assert isinstance(buffer, large_pages.LargePageBuffer) and table.pinned
    ((_, size, prop, _),) = fake.named("cuMemCreate")
    assert size == GRANULARITY and buffer.nbytes == weight.nbytes  # rounded up to 2 MiB
    assert (prop.type, prop.location.type, prop.location.id) == ("pinned", "host numa", 1)
    ((_, address, _, descriptions, _),) = fake.named("cuMemSetAccess")
    assert address == buffer.pointer == table.device_rows.data.ptr
    assert [(d.location.type, d.location.id, d.flags) for d in descriptions] == [
        ("device", 0, "rw"), ("device", 1, "rw"), ("host numa", 1, "rw")]  # every GPU reads
    np.testing.assert_array_equal(table.host_view, weight)  # written through the CPU mapping
    table.lookup(DeviceArray(silent_gpu, np.array([[3, 999]]), 0))  # read through the GPU mapping
    assert silent_gpu.syncs == []
    table.close()
    assert table.device_rows is None and not fake.named("cuMemUnmap")
    np.testing.assert_array_equal(table.host_view, weight)  # readable until its views go
    del table, buffer
    gc.collect()
    pinned.release_deferred()
    assert [call[0] for call in fake.calls[-3:]] == ["cuMemUnmap", "cuMemAddressFree",
                                                     "cuMemRelease"]


@pytest.mark.parametrize("fake", [FakeDriver(supported=0), FakeDriver(failing="cuMemMap"),
                                  FakeDriver(supported={0})],
                         ids=["unsupported", "map-fails", "another-gpu-unsupported"])
def test_without_large_pages_a_pinned_table_registers_its_memory_with_a_warning(
        silent_gpu, monkeypatch, fake):
    monkeypatch.setattr(large_pages, "driver", lambda: fake)
    monkeypatch.setenv(large_pages.GPU_PAGES_ENV, "large")
    with pytest.warns(RuntimeWarning, match="large GPU pages .* unavailable"):
        storage = nc.EmbeddingTable.empty(100, 8, np.float32, placement="pinned").storage
    assert type(storage.buffer) is pinned.PinnedBuffer and ("register", storage.buffer.pointer) \
        in silent_gpu.log
    undone = [call[0] for call in fake.calls if call[0] in ("cuMemAddressFree", "cuMemRelease")]
    assert undone == (["cuMemAddressFree", "cuMemRelease"] if fake.failing else [])


def test_the_choice_is_registered_by_default_and_checked(silent_gpu, monkeypatch):
    monkeypatch.setattr(large_pages, "driver", lambda: pytest.fail("driver asked"))
    storage = nc.EmbeddingTable.empty(100, 8, np.float32, placement="pinned").storage
    assert type(storage.buffer) is pinned.PinnedBuffer
    monkeypatch.setenv(large_pages.GPU_PAGES_ENV, "huge")
    with pytest.raises(ValueError, match="NGRAM_CUPY_GPU_PAGES must be one of 'registered', "
                                         "'large', got 'huge'"):
        nc.EmbeddingTable.empty(100, 8, np.float32, placement="pinned")


@pytest.mark.gpu
def test_on_a_gpu_a_large_page_table_gives_the_registered_tables_rows(monkeypatch):
    """The driver's own answer: a table in large GPU pages (or, refused, registered with the
    warning) looks up the same bits as a CPU table, and closes."""
    import warnings

    import cupy

    weight = np.random.default_rng(1).standard_normal((5000, 64)).astype(np.float32)
    ids = np.random.default_rng(2).integers(0, 5000, (256, 4))
    monkeypatch.setenv(large_pages.GPU_PAGES_ENV, "large")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        table = nc.EmbeddingTable(weight, placement="pinned")
    print("large pages:", type(table.storage.buffer).__name__, [str(w.message) for w in caught])
    got = cupy.asnumpy(table.lookup(cupy.asarray(ids)))
    np.testing.assert_array_equal(got, nc.EmbeddingTable(weight).lookup(ids))
    table.check()
    table.close()


def test_a_shared_table_stays_registered_and_says_so(silent_gpu, monkeypatch, shm_dir):
    """Its rows are a segment other processes map: the GPU maps it registered, with the
    warning when large pages were chosen."""
    monkeypatch.setattr(large_pages, "driver", lambda: pytest.fail("driver asked"))
    monkeypatch.setenv(large_pages.GPU_PAGES_ENV, "large")
    weight = np.arange(64, dtype=np.float32).reshape(16, 4)
    with pytest.warns(RuntimeWarning, match="registered, not in large GPU pages"):
        table = nc.EmbeddingTable(weight, placement="shared")
    assert type(table.storage.buffer) is pinned.PinnedBuffer and table.pinned
    table.close()
