"""Array sides as objects: ``HOST`` (NumPy) and ``DEVICE`` (CuPy).

A public function binds its array arguments once (:func:`bind`): NumPy, CuPy, PyTorch and any
DLPack or ``__cuda_array_interface__`` object is viewed zero-copy as a NumPy (host) or CuPy
(device) array, a mix of host and device arrays is refused, and the stream the kernels run on is
chosen. The side object then allocates, makes contiguous and enters the stream, so callers read the
same on both sides; and the call converts results back: **torch in gives torch out** (on the same
device, without a copy), and an ``out=`` given is exactly what is returned.

Streams. On the device, work runs on the ``stream`` given (a CuPy or torch stream, or anything in
the CUDA stream protocol); without one, on torch's current stream when any argument is a torch
tensor, else on CuPy's current stream. Torch tensors are imported for the kernels' stream and
results handed back from it, so a torch caller on its current stream (a ``torch.cuda.graph``
capture included) sees no cross-stream event at all, and another stream is ordered by DLPack's
event handshake on the GPU, never by a host synchronisation. Objects that only expose
``__cuda_array_interface__`` follow that protocol's rule instead (CuPy waits for the stream they
name).

CuPy is imported here only (:func:`cupy_module`), when a device array is first seen, so the CPU
path never needs it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from functools import cache, lru_cache
from typing import Any

import numpy as np

from ..formats import Format, bits_name, block_scale_type, find_format, raw_torch_name
from .install_hint import install_hint

_DLPACK_CPU, _DLPACK_CUDA, _DLPACK_CUDA_HOST = 1, 2, 3


def cupy_module():
    """The CuPy module, or a clear error when a device array arrives without it."""
    try:
        import cupy
    except ImportError:
        raise TypeError("a CUDA array was passed but CuPy is not installed: "
                        + install_hint("cuda12")) from None
    return cupy


@cache
def gpu_available() -> bool:
    """Whether CuPy is importable and sees a CUDA device (probed once per process)."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver, no device: all the same answer
        return False


def is_torch(value: Any) -> bool:
    """Whether ``value`` is a torch tensor (checked without importing torch)."""
    return type(value).__module__.startswith("torch") and hasattr(value, "data_ptr")


def unwrap_torch(value: Any) -> tuple[Any, Format | None]:
    """``(array, format)``: a torch bfloat16 / float8 tensor (which NumPy and DLPack consumers
    cannot type) becomes a same-width integer view and its format; a UE8M0 block-scale tensor
    its bytes (on the CPU as the ``ml_dtypes`` type, with no format); anything else passes."""
    if not is_torch(value):
        return value, None
    raw = raw_torch_name(value.dtype)
    scale_type = None if raw is not None else block_scale_type(value.dtype)
    if raw is None and scale_type is None:
        return value, None
    import torch

    if scale_type is not None:  # UE8M0 block scales: bytes that DLPack cannot type either
        bits = value.view(torch.uint8)
        return (bits.numpy().view(scale_type) if bits.device.type == "cpu" else bits), None
    return value.view(getattr(torch, raw)), find_format(value.dtype)


class Backend:
    """One array side: how to recognise, import, allocate and hand back its arrays."""

    name: str

    def __repr__(self) -> str:
        return self.name.upper()


class HostBackend(Backend):
    """NumPy arrays in host memory; kernels run on the calling thread (Numba)."""

    name = "host"

    def asarray(self, value: Any) -> np.ndarray:
        """A NumPy view of a host array (zero-copy through DLPack), or an array built from a
        sequence."""
        if isinstance(value, np.ndarray):
            return value
        if hasattr(value, "__dlpack__") and where(value) is HOST:
            return np.from_dlpack(value)
        return np.asarray(value)

    def empty(self, shape, dtype) -> np.ndarray:
        """A new uninitialised array."""
        return np.empty(shape, dtype=dtype)

    def contiguous(self, array) -> np.ndarray:
        """``array`` itself when C-contiguous, else a C-contiguous copy."""
        return np.ascontiguousarray(array)

    def kernel_stream(self, stream: Any, prefer_torch: bool = False,
                      device: int | None = None) -> None:
        """No streams on the host: a ``stream`` is a ValueError (nothing would run on it)."""
        if stream is not None:
            raise ValueError("stream is only for GPU arrays, but the arguments are on the CPU")
        return None

    def on(self, stream: Any):
        """Nothing to enter on the host."""
        return contextlib.nullcontext()

    def address(self, array) -> int:
        """The data pointer."""
        return array.ctypes.data

    def to_torch(self, array, fmt: Format | None = None, stream: Any = None):
        """A CPU torch tensor over ``array`` (zero-copy); ``fmt`` types bfloat16 bits."""
        import torch

        bits = bits_name(fmt)
        if bits is None:
            return torch.from_numpy(array)
        return torch.from_numpy(array.view(bits)).view(fmt.torch_dtype)


class DeviceBackend(Backend):
    """CuPy arrays in GPU memory; kernels run on a CUDA stream, never synchronising the host."""

    name = "device"

    def asarray(self, value: Any):
        """A CuPy view of a device array (zero-copy), or a device copy of a host sequence.

        DLPack producers (a CUDA torch tensor) are imported for CuPy's current stream, without a
        host synchronisation; enter ``on(stream)`` first to import for another stream.
        """
        cupy = cupy_module()
        if isinstance(value, cupy.ndarray):
            return value
        if hasattr(value, "__dlpack__") and where(value) is DEVICE:
            return cupy.from_dlpack(value)
        if hasattr(value, "__cuda_array_interface__"):
            return cupy.asarray(value)
        return cupy.asarray(np.asarray(value))

    def empty(self, shape, dtype):
        """A new uninitialised array, allocated for CuPy's current stream."""
        return cupy_module().empty(shape, dtype=dtype)

    def contiguous(self, array):
        """``array`` itself when C-contiguous, else a C-contiguous copy (on the current stream)."""
        return cupy_module().ascontiguousarray(array)

    def kernel_stream(self, stream: Any, prefer_torch: bool = False, device: int | None = None):
        """The CuPy stream kernels run on: ``stream`` (CuPy, torch, or ``__cuda_stream__``); else
        torch's current stream when ``prefer_torch``, else CuPy's current stream; the current
        streams those of ``device`` (the arguments' GPU) when given, not the current device's."""
        if stream is None and prefer_torch:
            import torch

            stream = torch.cuda.current_stream(device)
        return cuda_stream(stream, device)

    def on(self, stream: Any):
        """``stream`` as CuPy's current stream, its device as the current device (launches and
        allocations then go to the stream's GPU, whichever device was current)."""
        device = getattr(stream, "device_id", -1)
        if not isinstance(device, int) or device < 0:
            return stream
        return on_device(stream, device)

    def address(self, array) -> int:
        """The device pointer."""
        return array.data.ptr

    def to_torch(self, array, fmt: Format | None = None, stream: Any = None):
        """A CUDA torch tensor over ``array`` (zero-copy), ordered after the work of ``stream``
        (the stream that produced it) on torch's current stream; ``fmt`` types bfloat16 bits."""
        import torch

        bits = bits_name(fmt)
        with stream if stream is not None else contextlib.nullcontext():
            # CuPy's current stream is the producer's: DLPack orders torch's current one after
            # it, with no event at all when the two are the same stream
            tensor = torch.from_dlpack(array if bits is None else array.view(bits))
        return tensor if bits is None else tensor.view(fmt.torch_dtype)


HOST, DEVICE = HostBackend(), DeviceBackend()


@contextlib.contextmanager
def on_device(stream: Any, device: int):
    """CuPy's current device ``device`` and current stream ``stream`` inside the block."""
    with cupy_module().cuda.Device(device), stream:
        yield stream


def device_index(value: Any) -> int | None:
    """The GPU ordinal of a CUDA array (DLPack or CuPy); None for anything else."""
    if hasattr(value, "__dlpack_device__"):
        kind, index = value.__dlpack_device__()
        return int(index) if kind == _DLPACK_CUDA else None
    device = getattr(value, "device", None)
    index = getattr(device, "id", None)
    return index if isinstance(index, int) else None


def where(value: Any) -> Backend | None:
    """HOST or DEVICE for an array-like object; None for plain Python sequences and scalars."""
    if isinstance(value, np.ndarray):
        return HOST
    if hasattr(value, "__dlpack_device__"):  # cheaper than building a CUDA array interface
        kind = value.__dlpack_device__()[0]
        if kind == _DLPACK_CUDA:
            return DEVICE
        if kind in (_DLPACK_CPU, _DLPACK_CUDA_HOST):
            return HOST
        raise TypeError(f"unsupported DLPack device type {kind}")
    if hasattr(value, "__cuda_array_interface__"):
        return DEVICE
    if hasattr(value, "__array__") or hasattr(value, "__array_interface__"):
        return HOST
    return None


def placement(**arrays: Any) -> Backend:
    """HOST or DEVICE for a call's named arguments; a ``ValueError`` naming them if they mix."""
    placed = {name: where(value) for name, value in arrays.items() if value is not None}
    sides = {side for side in placed.values() if side is not None}
    if len(sides) > 1:
        host = sorted(name for name, side in placed.items() if side is HOST)
        device = sorted(name for name, side in placed.items() if side is DEVICE)
        raise ValueError(
            f"arguments on different devices: {', '.join(device)} on the GPU but "
            f"{', '.join(host)} on the CPU"
        )
    return sides.pop() if sides else HOST


def convert(**arrays: Any) -> tuple[Backend, dict[str, Any]]:
    """Bring named arguments to one side: ``(HOST, numpy arrays)`` or ``(DEVICE, cupy arrays)``.

    Plain sequences follow the arrays; ``None`` passes through. A mix of host and device arrays,
    or device arrays on different GPUs, is a ``ValueError`` naming the arguments.
    """
    side = placement(**arrays)
    converted = {name: None if value is None else side.asarray(value)
                 for name, value in arrays.items()}
    if side is DEVICE:
        devices = {name: a.device.id for name, a in converted.items() if a is not None}
        if len(set(devices.values())) > 1:
            raise ValueError(f"device arrays on different GPUs: {devices}")
    return side, converted


@dataclass
class Call:
    """One call's arguments on their side: the side, the kernels' stream (None on the host),
    the converted arrays, the formats of torch bfloat16 / float8 arguments (passed as their
    bits), the caller's own objects, and whether results go back as torch tensors."""

    side: Backend
    stream: Any
    arrays: dict[str, Any]
    formats: dict[str, Format] = field(default_factory=dict)
    given: dict[str, Any] = field(default_factory=dict)
    torch: bool = False

    def __getitem__(self, name: str) -> Any:
        return self.arrays[name]

    def on(self):
        """The kernels' stream as the current one (device), or nothing (host)."""
        return self.side.on(self.stream)

    def result(self, array, fmt: Format | None = None, out: str = "out"):
        """What the call returns for ``array``: the caller's ``out`` object when one was given,
        a torch tensor when torch tensors came in, else ``array`` itself."""
        if self.given.get(out) is not None:
            return self.given[out]
        if self.torch:
            return self.side.to_torch(array, fmt, self.stream)
        return array


def bind(stream: Any = None, **arrays: Any) -> Call:
    """Bind one call's named array arguments (None passes through) and its ``stream``.

    Device arguments are imported for the stream the kernels will run on; a ``stream`` with host
    arrays is a ``ValueError``; bad streams are a ``TypeError`` before any device work.
    """
    if stream is None and all(value is None or type(value) is np.ndarray
                              for value in arrays.values()):
        return Call(HOST, None, dict(arrays), {}, dict(arrays), False)  # NumPy: nothing to do
    formats, unwrapped = {}, {}
    for name, value in arrays.items():
        unwrapped[name], fmt = unwrap_torch(value)
        if fmt is not None:
            formats[name] = fmt
    torch_in = any(is_torch(value) for value in arrays.values())
    side = placement(**unwrapped)
    devices = [device_index(value) for value in unwrapped.values() if value is not None]
    device = next((index for index in devices if index is not None), None)
    kernels_stream = side.kernel_stream(stream, prefer_torch=torch_in, device=device)
    with side.on(kernels_stream):
        _, converted = convert(**unwrapped)
    return Call(side, kernels_stream, converted, formats, dict(arrays), torch_in)


class _StreamHandle:
    """A raw ``cudaStream_t`` in the CUDA stream protocol (for ``Stream.from_external``)."""

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return 0, self.handle


@lru_cache(maxsize=64)
def _external_stream(handle: int, device: int | None = None):
    """A CuPy stream for a foreign handle on ``device`` (when known), made once per handle and
    device (the wrapper owns nothing)."""
    cupy = cupy_module()
    if handle == 0:
        return cupy.cuda.Stream.null
    if device is not None and hasattr(cupy.cuda, "ExternalStream"):
        return cupy.cuda.ExternalStream(handle, device)  # knows its device
    if hasattr(cupy.cuda.Stream, "from_external"):  # CuPy >= 14
        return cupy.cuda.Stream.from_external(_StreamHandle(handle))
    return cupy.cuda.ExternalStream(handle)


def torch_stream_device(stream: Any) -> int | None:
    """The GPU of a torch stream (``stream.device.index``); None for other streams."""
    index = getattr(getattr(stream, "device", None), "index", None)
    return index if isinstance(index, int) else None


def cuda_stream(stream: Any = None, device: int | None = None):
    """The CuPy stream kernels run on: CuPy's current one (of ``device`` when given), or the
    given CuPy/PyTorch stream.

    Accepts a CuPy stream, a ``torch.cuda.Stream``, or any object in the CUDA stream protocol
    (``__cuda_stream__``); anything else is a ``TypeError`` naming ``stream``. A foreign
    stream is taken to be on its own device (torch's), else on ``device``.
    """
    cupy = cupy_module()
    if stream is None:
        if device is None:
            return cupy.cuda.get_current_stream()
        with cupy.cuda.Device(device):
            return cupy.cuda.get_current_stream()
    if isinstance(stream, cupy.cuda.Stream | cupy.cuda.ExternalStream):
        return stream
    own = torch_stream_device(stream)
    device = own if own is not None else device
    if hasattr(stream, "__cuda_stream__"):
        handle = stream.__cuda_stream__()[1]
    else:
        handle = getattr(stream, "cuda_stream", None)  # torch streams before the protocol
    if isinstance(handle, bool) or not isinstance(handle, int):
        raise TypeError(
            f"stream must be a CuPy or torch CUDA stream (or have __cuda_stream__), "
            f"got {type(stream).__name__}"
        )
    return _external_stream(handle, device)


def data_address(array) -> int:
    """Address of an array's first element: a CuPy array's device pointer, a NumPy array's."""
    data = array.data
    return data.ptr if hasattr(data, "ptr") else array.ctypes.data
