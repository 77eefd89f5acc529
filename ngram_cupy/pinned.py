"""Page-locked host memory of exactly the requested size, readable by the GPU (UVA).

An anonymous ``mmap`` registered with ``cudaHostRegister`` (portable and mapped) rather than a
pinned-memory pool: a pool rounds allocations up to powers of two, turning a 47.7 GiB table into
64 GiB. The registration is released by ``close()`` or when the buffer is garbage-collected.
"""

from __future__ import annotations

import mmap
import weakref

import numpy as np

# cudaHostRegisterPortable | cudaHostRegisterMapped: every device and context may map it.
_REGISTER_FLAGS = 0x01 | 0x02


def _unregister(pointer: int) -> None:
    """Release one registration once the GPU is done with it (the finaliser: it must not refer
    to the buffer object)."""
    import cupy

    cupy.cuda.runtime.deviceSynchronize()  # no kernel may still read the rows
    cupy.cuda.runtime.hostUnregister(pointer)


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


class PinnedBuffer:
    """``nbytes`` of page-locked host memory, as a NumPy byte array and a GPU-visible address."""

    def __init__(self, nbytes: int, device: int | None = None):
        import cupy

        if nbytes <= 0:
            raise ValueError(f"nbytes must be positive, got {nbytes}")
        self.nbytes = int(nbytes)
        self._map = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE)  # anonymous, this process
        if hasattr(mmap, "MADV_HUGEPAGE"):  # fewer pages to lock and to map into the GPU
            self._map.madvise(mmap.MADV_HUGEPAGE)
        self.array = np.frombuffer(self._map, dtype=np.uint8)
        self.pointer = self.array.ctypes.data
        try:
            self.device = cupy.cuda.runtime.getDevice() if device is None else int(device)
            if not cupy.cuda.runtime.deviceGetAttribute(
                    cupy.cuda.runtime.cudaDevAttrCanUseHostPointerForRegisteredMem, self.device):
                raise RuntimeError("the device cannot read registered host memory at its "
                                   "host address")
            cupy.cuda.runtime.hostRegister(self.pointer, self.nbytes, _REGISTER_FLAGS)
        except Exception as error:
            raise _registration_error(self.nbytes, error) from error
        self._finalizer = weakref.finalize(self, _unregister, self.pointer)
        self._finalizer.atexit = False  # at exit the process's memory goes anyway

    @property
    def registered(self) -> bool:
        """Whether the memory is still page-locked and mapped for the GPU."""
        return self._finalizer.alive

    def device_array(self, shape: tuple[int, ...], dtype):
        """A CuPy array over the mapped memory: GPU kernels read the host rows through it (UVA)."""
        import cupy

        if not self.registered:
            raise ValueError("the pinned buffer is closed")
        memory = cupy.cuda.UnownedMemory(self.pointer, self.nbytes, self, self.device)
        return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(memory, 0))

    def close(self) -> None:
        """Unregister the memory now; the NumPy view stays readable as ordinary memory."""
        self._finalizer()

    def __enter__(self) -> PinnedBuffer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
