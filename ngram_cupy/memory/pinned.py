"""Page-locked host memory of exactly the requested size, readable by the GPU (UVA).

An anonymous ``mmap`` registered with ``cudaHostRegister`` (portable and mapped) rather than a
pinned-memory pool: a pool rounds allocations up to powers of two, turning a 47.7 GiB table into
64 GiB.

Release never synchronises the whole device: ``cudaDeviceSynchronize`` fails inside a
global-mode CUDA graph capture, and ruins it. Each buffer remembers the streams whose kernels read
it (``used_on``); ``close()`` waits for those streams only, then unregisters. Garbage collection
(which may run in the middle of someone's capture) makes no CUDA call at all: it queues the
registration, and the queue is released at the next ``close()``, the next ``PinnedBuffer`` or
``release_deferred()``, skipping any registration one of whose streams is capturing.
"""

from __future__ import annotations

import mmap
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from ..runtime.backends import cupy_module
from ..runtime.used_streams import UsedStreams
from .anonymous import advise, anonymous_memory

# cudaHostRegisterPortable | cudaHostRegisterMapped: every device and context may map it.
_REGISTER_FLAGS = 0x01 | 0x02


def host_unregister(pointer: int) -> None:
    """``cudaHostUnregister``."""
    cupy_module().cuda.runtime.hostUnregister(pointer)


class Registration:
    """One registered range and the memory behind it (kept mapped until unregistered by
    ``unregister(pointer)``: ``cudaHostUnregister`` when None)."""

    def __init__(self, pointer: int, memory: Any,
                 unregister: Callable[[int], None] | None = None):
        self.pointer = pointer
        self.memory = memory
        self.unregister = unregister
        self.streams = UsedStreams()  # the streams that read the memory

    @property
    def released(self) -> bool:
        """Whether the range is unregistered."""
        return self.memory is None

    def used_on(self, stream: Any) -> None:
        """Remember a stream that reads the memory."""
        self.streams.add(stream)

    def release(self) -> bool:
        """Wait for the streams that read the memory, then unregister it. While any of them is
        capturing a CUDA graph nothing is done (a wait would break the capture): False."""
        if self.released:
            return True
        if self.streams.capturing():
            return False
        self.streams.synchronize()
        (self.unregister or host_unregister)(self.pointer)
        self.memory = None
        return True


_deferred: list[Registration] = []


def queue_release(registration: Registration) -> None:
    """The finaliser: queue the release (no CUDA call here)."""
    _deferred.append(registration)


def release_deferred() -> int:
    """Release the queued registrations of collected buffers that can be released now; return
    how many are still queued. One that fails to unregister (a CUDA error) is dropped with a
    warning: it would fail again, and must not stop the others or later pinned allocations."""
    queued, kept = list(_deferred), []
    for registration in queued:
        try:
            if not registration.release():
                kept.append(registration)
        except Exception as error:  # a CUDA error: this registration only
            warnings.warn(f"could not unregister pinned host memory at {registration.pointer:#x} "
                          f"({error}); dropped", RuntimeWarning, stacklevel=2)
    _deferred[:] = kept + _deferred[len(queued):]  # and any queued meanwhile (a collection)
    return len(_deferred)


def _registration_error(nbytes: int, error: Exception) -> RuntimeError:
    """A readable reason for a failed cudaHostRegister."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft:,} bytes"
    return RuntimeError(
        f"could not page-lock {nbytes:,} bytes of host memory for the GPU ({error}); it needs a "
        f"CUDA device, enough free RAM and a locked-memory limit (ulimit -l, now {limit}) of at "
        "least the table size"
    )


class MappedHostBuffer:
    """Host memory the GPU reads at its host address: the NumPy byte array ``array``, its
    ``pointer``, the streams that read it, and its release (see the module's docstring)."""

    nbytes: int
    array: np.ndarray
    pointer: int
    device: int

    def track(self, registration: Registration) -> None:
        """Release ``registration`` at ``close``, or queue it when the buffer is collected."""
        self._registration = registration
        self._finalizer = weakref.finalize(self, queue_release, registration)
        self._finalizer.atexit = False  # at exit the process's memory goes anyway

    @property
    def registered(self) -> bool:
        """Whether the memory is still page-locked and mapped for the GPU."""
        return not self._registration.released

    def used_on(self, stream: Any) -> None:
        """Note that a kernel reading this memory runs on ``stream`` (a CuPy stream)."""
        self._registration.used_on(stream)

    def device_array(self, shape: tuple[int, ...], dtype):
        """A CuPy array over the mapped memory: GPU kernels read the host rows through it (UVA)."""
        cupy = cupy_module()
        if not self.registered:
            raise ValueError("the pinned buffer is closed")
        memory = cupy.cuda.UnownedMemory(self.pointer, self.nbytes, self, self.device)
        return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(memory, 0))

    def close(self) -> None:
        """Release the memory now, after the streams that read it. Inside a capture on one of
        those streams: a RuntimeError."""
        if not self._registration.release():
            raise RuntimeError("cannot release pinned memory while a stream that reads it is "
                               "capturing a CUDA graph: close it after the capture")
        self._finalizer.detach()
        release_deferred()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class PinnedBuffer(MappedHostBuffer):
    """``nbytes`` of page-locked host memory, as a NumPy byte array and a GPU-visible address.

    ``memory``: an existing mapping of at least ``nbytes`` to page-lock (a shared-memory
    segment), instead of new private memory (in huge pages, see ``anonymous``). Either way
    it is advised ``MADV_DONTFORK``: a ``fork()`` does not copy (or share) locked pages.
    ``close`` unregisters; the NumPy view stays readable as ordinary memory.
    """

    def __init__(self, nbytes: int, device: int | None = None, memory: mmap.mmap | None = None,
                 huge_pages: bool | None = None):
        if nbytes <= 0:
            raise ValueError(f"nbytes must be positive, got {nbytes}")
        self.nbytes = int(nbytes)
        if memory is None:  # anonymous, this process; huge pages: fewer pages to lock and map
            memory = anonymous_memory(self.nbytes, huge_pages)
        self.array = np.frombuffer(memory, dtype=np.uint8, count=self.nbytes)
        self.pointer = self.array.ctypes.data
        try:
            cupy = cupy_module()
            release_deferred()
            self.device = cupy.cuda.runtime.getDevice() if device is None else int(device)
            if not cupy.cuda.runtime.deviceGetAttribute(
                    cupy.cuda.runtime.cudaDevAttrCanUseHostPointerForRegisteredMem, self.device):
                raise RuntimeError("the device cannot read registered host memory at its "
                                   "host address")
            cupy.cuda.runtime.hostRegister(self.pointer, self.nbytes, _REGISTER_FLAGS)
        except Exception as error:
            raise _registration_error(self.nbytes, error) from error
        advise(memory, "MADV_DONTFORK")
        self.track(Registration(self.pointer, memory))
