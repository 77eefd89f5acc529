"""Host tables the GPU maps in large pages: ``cuMemCreate`` on the GPU's host NUMA node.

Random row reads of a pinned table over UVA are limited by the GPU's TLB: memory registered
with ``cudaHostRegister`` (``pinned``) is mapped for the GPU in small pages, whatever pages the
host uses. Memory made by the driver's virtual memory calls on a host NUMA node
(``CU_MEM_LOCATION_TYPE_HOST_NUMA``) is mapped in the allocation's granularity, 2 MiB, and
mapped for the CPU at the same address. The choice, per table storage or for the process:

- ``gpu_pages="large"`` where a function takes it (``PinnedStorage``), or the environment
  variable ``NGRAM_CUPY_GPU_PAGES=large`` for every pinned table of the process;
- ``"registered"`` (the default): ``cudaHostRegister`` of anonymous memory (``pinned``).

Every GPU of the process is granted access (registered memory is portable: a table is looked up
from any of them); where one of them cannot map host NUMA memory, the table is registered.

Where the driver or its Python bindings (``cuda.bindings``, installed with numba-cuda) cannot
make such memory, the table falls back to registered memory with a ``RuntimeWarning``. The size
is rounded up to the granularity. ``close`` stops GPU reads (after the streams that read the
memory); the memory itself is unmapped when the last NumPy view of it is gone (the rows stay
readable on the host until then, as a closed pinned table's do).
"""

from __future__ import annotations

import ctypes
import os
import warnings
import weakref
from typing import Any

import numpy as np

from ..runtime.backends import cupy_module
from .pinned import (
    MappedHostBuffer,
    PinnedBuffer,
    Registration,
    queue_release,
    release_deferred,
)

GPU_PAGES_ENV = "NGRAM_CUPY_GPU_PAGES"
GPU_PAGES = ("registered", "large")


class LargePagesUnavailable(RuntimeError):
    """The driver (or its bindings) cannot map host memory for the GPU in large pages here."""


def gpu_pages_wanted(gpu_pages: str | None = None) -> str:
    """``gpu_pages`` when given, else the environment's choice (default ``"registered"``); a
    ValueError naming the choices otherwise."""
    source = "gpu_pages" if gpu_pages is not None else GPU_PAGES_ENV
    value = gpu_pages if gpu_pages is not None else os.environ.get(GPU_PAGES_ENV, "registered")
    if value not in GPU_PAGES:
        raise ValueError(f"{source} must be one of {', '.join(map(repr, GPU_PAGES))}, got "
                         f"{value!r}")
    return value


def driver():
    """``cuda.bindings.driver`` with host NUMA allocations, or LargePagesUnavailable."""
    try:
        from cuda.bindings import driver as bindings
    except ImportError as error:
        raise LargePagesUnavailable(f"no cuda.bindings ({error})") from None
    if not hasattr(bindings.CUdevice_attribute,
                   "CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED"):
        raise LargePagesUnavailable("this cuda.bindings predates host NUMA allocations")
    return bindings


def checked(bindings, name: str, *args) -> Any:
    """``bindings.name(*args)``: its value (None, one value, or a tuple), or
    LargePagesUnavailable naming the call and its CUresult."""
    error, *values = getattr(bindings, name)(*args)
    if error != bindings.CUresult.CUDA_SUCCESS:
        raise LargePagesUnavailable(f"{name} failed: {error}")
    return values[0] if len(values) == 1 else (tuple(values) or None)


def host_numa_allocation(bindings, device: int):
    """The allocation properties of pinned memory on ``device``'s host NUMA node (node 0
    where the system reports none)."""
    attributes = bindings.CUdevice_attribute
    if not checked(bindings, "cuDeviceGetAttribute", attributes.
                   CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, device):
        raise LargePagesUnavailable(f"GPU {device} maps no host NUMA memory of its own")
    node = checked(bindings, "cuDeviceGetAttribute",
                   attributes.CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID, device)
    prop = bindings.CUmemAllocationProp()
    prop.type = bindings.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = bindings.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST_NUMA
    prop.location.id = max(int(node), 0)
    return prop


def mapping_devices(bindings) -> range:
    """Every GPU of the process, each of which may look the table up (as registered memory is
    portable): LargePagesUnavailable when one of them cannot map host NUMA memory."""
    devices = range(int(checked(bindings, "cuDeviceGetCount")))
    for gpu in devices:
        if not checked(bindings, "cuDeviceGetAttribute", bindings.CUdevice_attribute.
                       CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, gpu):
            raise LargePagesUnavailable(f"GPU {gpu} maps no host NUMA memory, and every GPU "
                                        "of the process may look the table up")
    return devices


def access(bindings, location_type, location_id: int):
    """Read-write access for one location."""
    desc = bindings.CUmemAccessDesc()
    desc.location.type = location_type
    desc.location.id = location_id
    desc.flags = bindings.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return desc


class LargePageBuffer(MappedHostBuffer):
    """At least ``nbytes`` of pinned host memory on the GPU's host NUMA node, mapped for the GPU
    (in the allocation's large pages) and the CPU at one address: ``array``, ``pointer``,
    ``device_array`` and ``close`` as ``PinnedBuffer``'s."""

    def __init__(self, nbytes: int, device: int | None = None):
        if nbytes <= 0:
            raise ValueError(f"nbytes must be positive, got {nbytes}")
        bindings, cupy = driver(), cupy_module()
        release_deferred()
        self.device = cupy.cuda.runtime.getDevice() if device is None else int(device)
        with cupy.cuda.Device(self.device):
            cupy.cuda.runtime.free(0)  # the device's context, current for the driver calls
            prop = host_numa_allocation(bindings, self.device)
            granularity = int(checked(
                bindings, "cuMemGetAllocationGranularity", prop, bindings.
                CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED))
            size = -(-int(nbytes) // granularity) * granularity
            locations = bindings.CUmemLocationType
            grants = [access(bindings, locations.CU_MEM_LOCATION_TYPE_DEVICE, gpu)
                      for gpu in mapping_devices(bindings)]
            grants.append(access(bindings, locations.CU_MEM_LOCATION_TYPE_HOST_NUMA,
                                 prop.location.id))
            undo = []
            try:
                handle = checked(bindings, "cuMemCreate", size, prop, 0)
                undo.append(lambda: checked(bindings, "cuMemRelease", handle))
                address = checked(bindings, "cuMemAddressReserve", size, granularity, 0, 0)
                undo.append(lambda: checked(bindings, "cuMemAddressFree", address, size))
                checked(bindings, "cuMemMap", address, size, 0, handle, 0)
                undo.append(lambda: checked(bindings, "cuMemUnmap", address, size))
                checked(bindings, "cuMemSetAccess", address, size, grants, len(grants))
            except BaseException:
                for step in reversed(undo):
                    step()
                raise
        self.nbytes, self.granularity = int(nbytes), granularity
        self.pointer = int(address)
        raw = (ctypes.c_uint8 * size).from_address(self.pointer)
        self.array = np.frombuffer(raw, np.uint8, count=self.nbytes)  # keeps ``raw`` alive

        def unmap(pointer: int) -> None:
            for step in reversed(undo):
                step()

        self.closed = False
        self._registration = Registration(self.pointer, True, unmap)
        # Unmapped once the last view of the memory is gone (queued: no CUDA call in a
        # collection), not when this buffer is.
        self._finalizer = weakref.finalize(raw, queue_release, self._registration)
        self._finalizer.atexit = False

    @property
    def registered(self) -> bool:
        """Whether the GPU may still read the memory (until ``close``)."""
        return not self.closed

    def close(self) -> None:
        """Stop GPU reads, after the streams that read the memory (a RuntimeError inside a
        capture on one of them); the host rows stay readable while a view of them lives."""
        registration = self._registration
        if registration.streams.capturing():
            raise RuntimeError("cannot release pinned memory while a stream that reads it is "
                               "capturing a CUDA graph: close it after the capture")
        registration.streams.synchronize()
        self.closed = True
        release_deferred()


def host_buffer(nbytes: int, gpu_pages: str | None = None) -> MappedHostBuffer:
    """Host memory the GPU reads of a pinned table: in large GPU pages when chosen
    (``gpu_pages_wanted``) and possible, else (with a warning when chosen) registered."""
    if gpu_pages_wanted(gpu_pages) == "large":
        try:
            return LargePageBuffer(nbytes)
        except LargePagesUnavailable as error:
            warnings.warn(f"large GPU pages for a {nbytes:,}-byte host table are unavailable "
                          f"({error}): registering ordinary pinned memory instead",
                          RuntimeWarning, stacklevel=2)
    return PinnedBuffer(nbytes)
