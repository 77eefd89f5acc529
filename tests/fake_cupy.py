"""A CuPy stand-in with several GPUs, for the device-following logic on machines without one:
the current device (entered with ``cuda.Device``), streams that know their device, and a log.

``install_fake_cupy`` also gives it device arrays (host memory that says it is on a GPU), pinned
memory and registration calls, so a table's GPU paths run on the CPU up to the kernel launch, and
counts every host synchronisation in ``syncs``: ``Stream.synchronize``, ``Event.synchronize``,
an array's blocking ``get``, ``asnumpy`` and ``runtime.deviceSynchronize``.
"""

from __future__ import annotations

import ctypes
import sys
import types as pytypes

import numpy as np


class FakeCupy:
    """``cuda.Device``, ``cuda.Stream``, ``cuda.ExternalStream``, ``cuda.Event`` and
    ``cuda.get_current_stream``, recording what happens in ``log`` and each host wait in
    ``syncs``."""

    def __init__(self) -> None:
        self.current = 0
        self.log: list[tuple] = []
        self.syncs: list[str] = []
        self.events_done = True  # what ``Event.done`` (an event query) answers
        cupy = self
        entered: dict[int, list] = {}  # the streams entered (``with stream:``), by device
        streams: dict[int, object] = {}  # each device's default stream

        class Device:
            def __init__(self, device=None):
                self.id = cupy.current if device is None else int(device)
                self.compute_capability = "90"

            def __enter__(self):
                self.previous, cupy.current = cupy.current, self.id
                cupy.log.append(("device", self.id))
                return self

            def __exit__(self, *exc):
                cupy.current = self.previous

        class Stream:
            capturing = False

            def __init__(self, non_blocking=False, ptr=0x1000, device_id=None):
                self.ptr = ptr
                self.device_id = cupy.current if device_id is None else device_id
                cupy.log.append(("stream made", self.device_id))

            def __enter__(self):
                cupy.log.append(("stream", self.ptr, cupy.current))
                entered.setdefault(cupy.current, []).append(self)
                return self

            def __exit__(self, *exc):
                entered[cupy.current].pop()

            def is_capturing(self):
                return self.capturing

            def synchronize(self):
                cupy.syncs.append("Stream.synchronize")

            def wait_event(self, event):
                cupy.log.append(("wait", self.ptr, event))

        class ExternalStream(Stream):
            def __init__(self, ptr, device_id=-1):
                super().__init__(ptr=ptr, device_id=device_id)

        class Event:
            def __init__(self, disable_timing=False):
                cupy.log.append(("event made", cupy.current))

            def record(self, stream=None):
                cupy.log.append(("record", getattr(stream, "ptr", None), self))

            def synchronize(self):
                cupy.syncs.append("Event.synchronize")

            @property
            def done(self):
                cupy.log.append(("query", self))
                return cupy.events_done

        def current_stream():
            """The stream entered last on the current device, else its one default stream."""
            if entered.get(cupy.current):
                return entered[cupy.current][-1]
            if cupy.current not in streams:
                streams[cupy.current] = Stream(ptr=0x100 + cupy.current)
            return streams[cupy.current]

        self.cuda = pytypes.SimpleNamespace(
            Device=Device, Stream=Stream, ExternalStream=ExternalStream, Event=Event,
            get_current_stream=current_stream)


class DeviceArray:
    """Host memory that says it is on a GPU: what the GPU paths read of a CuPy array (shape,
    dtype, strides, address, device), views, and a ``get`` that counts as a host wait."""

    def __init__(self, cupy: FakeCupy, host: np.ndarray, device: int, owner=None):
        self.cupy, self.host, self.device_id, self.owner = cupy, host, device, owner

    def __getattr__(self, name):
        if name in ("shape", "dtype", "ndim", "size", "strides", "nbytes", "flags", "itemsize"):
            return getattr(self.host, name)
        raise AttributeError(name)

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "typestr": self.dtype.str, "version": 3,
                "data": (self.host.ctypes.data, False), "strides": self.strides}

    @property
    def device(self):
        return self.cupy.cuda.Device(self.device_id)

    @property
    def data(self):
        return pytypes.SimpleNamespace(ptr=self.host.ctypes.data)

    def _wrap(self, host: np.ndarray) -> DeviceArray:
        return DeviceArray(self.cupy, host, self.device_id, self.owner or self)

    def view(self, dtype):
        return self._wrap(self.host.view(dtype))

    def reshape(self, *shape):
        return self._wrap(self.host.reshape(*shape))

    def ravel(self):
        return self._wrap(self.host.ravel())

    def astype(self, dtype):
        return self._wrap(self.host.astype(dtype))

    def copy(self):
        return self._wrap(self.host.copy())

    def __getitem__(self, key):
        return self._wrap(self.host[key])

    def __setitem__(self, key, value):
        self.host[key] = value.host if isinstance(value, DeviceArray) else value

    def __len__(self):
        return len(self.host)

    def fill(self, value):
        self.host.fill(value)

    def set(self, array, stream=None):
        self.host[...] = array

    def get(self, stream=None, out=None, blocking=True):
        if blocking:
            self.cupy.syncs.append("get")
        if out is None:
            return self.host.copy()
        out[...] = self.host
        return out


def install_fake_cupy(monkeypatch, cupy: FakeCupy | None = None) -> FakeCupy:
    """Put ``cupy`` (a new FakeCupy by default), with device arrays, pinned memory and a GPU,
    in place of CuPy for every loaded ``ngram_cupy`` module (undone by ``monkeypatch``)."""
    cupy = cupy or FakeCupy()

    def wrap(host):
        return DeviceArray(cupy, host, cupy.current)

    def asarray(value, dtype=None):
        if isinstance(value, DeviceArray):
            return value if dtype is None else value.astype(dtype)
        return wrap(np.array(value, dtype=dtype))

    def ndarray(shape, dtype, memptr):
        """An array over a registered host range (``UnownedMemory``), as PinnedBuffer makes."""
        memory = memptr.mem
        count = int(np.prod(shape)) * np.dtype(dtype).itemsize
        raw = (ctypes.c_uint8 * count).from_address(memory.ptr + memptr.offset)
        host = np.frombuffer(raw, np.uint8).view(dtype).reshape(shape)
        return DeviceArray(cupy, host, memory.device_id, memory.owner)

    def asnumpy(array, stream=None):
        cupy.syncs.append("asnumpy")
        return array.host.copy() if isinstance(array, DeviceArray) else np.asarray(array)

    def device_synchronize():
        cupy.syncs.append("runtime.deviceSynchronize")

    class ArrayType(type):
        """``cupy.ndarray``: ``isinstance`` of any device array; called, an array over memory."""

        def __instancecheck__(cls, value):
            return isinstance(value, DeviceArray)

        def __call__(cls, shape, dtype, memptr):
            return ndarray(shape, dtype, memptr)

    cupy.ndarray = ArrayType("ndarray", (), {})
    cupy.asarray = asarray
    cupy.ascontiguousarray = lambda a: a if a.flags.c_contiguous else a.copy()
    cupy.empty = lambda shape, dtype=np.float32: wrap(np.empty(shape, dtype))
    cupy.zeros = lambda shape, dtype=np.float32: wrap(np.zeros(shape, dtype))
    cupy.full = lambda shape, value, dtype=None: wrap(np.full(shape, value, dtype))
    cupy.empty_like = lambda a: wrap(np.empty_like(a.host))
    cupy.zeros_like = lambda a: wrap(np.zeros_like(a.host))
    cupy.asnumpy = asnumpy
    cupy.cuda.alloc_pinned_memory = bytearray
    cupy.cuda.UnownedMemory = lambda ptr, size, owner, device_id: pytypes.SimpleNamespace(
        ptr=ptr, size=size, owner=owner, device_id=device_id)
    cupy.cuda.MemoryPointer = lambda mem, offset: pytypes.SimpleNamespace(mem=mem, offset=offset)
    cupy.cuda.runtime = pytypes.SimpleNamespace(
        getDevice=lambda: cupy.current, getDeviceCount=lambda: 1,
        deviceGetAttribute=lambda attribute, device: 1,
        cudaDevAttrCanUseHostPointerForRegisteredMem=91,
        hostRegister=lambda pointer, size, flags: cupy.log.append(("register", pointer)),
        hostUnregister=lambda pointer: cupy.log.append(("unregister", pointer)),
        deviceSynchronize=device_synchronize, free=lambda pointer: None,
        memcpyDeviceToHost=2, memcpyAsync=lambda dst, src, size, kind, stream: ctypes.memmove(
            dst, src, size))
    for name, module in list(sys.modules.items()):
        if name.startswith("ngram_cupy"):
            if hasattr(module, "cupy_module"):
                monkeypatch.setattr(module, "cupy_module", lambda: cupy)
            if hasattr(module, "gpu_available"):
                monkeypatch.setattr(module, "gpu_available", lambda: True)
    return cupy
