"""Array interop: accept NumPy, CuPy, PyTorch and any DLPack / CUDA-array-interface object.

Every public function converts its array arguments here, zero-copy, to NumPy (host) or CuPy
(device) arrays, and refuses a mix of host and device arrays. CuPy is imported only when a device
array is seen, so the CPU path never needs it.

Device imports never synchronise with the host when the producer speaks DLPack (PyTorch, CuPy,
JAX): the producer orders its pending work before CuPy's current stream, on the GPU. Objects that
only expose ``__cuda_array_interface__`` follow that protocol's rule instead (CuPy waits for the
stream they name), so prefer DLPack producers in a forward pass or a CUDA graph capture.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np

HOST, DEVICE = "host", "device"
_DLPACK_CPU, _DLPACK_CUDA, _DLPACK_CUDA_HOST = 1, 2, 3


def _cupy():
    """The CuPy module, or a clear error when a device array arrives without it."""
    try:
        import cupy
    except ImportError:
        raise TypeError(
            "a CUDA array was passed but CuPy is not installed: pip install 'ngram-cupy[cuda12]'"
        ) from None
    return cupy


def where(value: Any) -> str | None:
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


def to_host(value: Any) -> np.ndarray:
    """A NumPy view of a host array (zero-copy through DLPack) or an array built from a sequence."""
    if isinstance(value, np.ndarray):
        return value
    if hasattr(value, "__dlpack__") and where(value) == HOST:
        return np.from_dlpack(value)
    return np.asarray(value)


def to_device(value: Any):
    """A CuPy view of a device array (zero-copy), or a device copy of a host sequence.

    DLPack producers (a CUDA torch tensor) are imported for CuPy's current stream, without a host
    synchronisation; run under ``with cuda_stream(stream):`` to import for another stream.
    """
    cupy = _cupy()
    if isinstance(value, cupy.ndarray):
        return value
    if hasattr(value, "__dlpack__") and where(value) == DEVICE:
        return cupy.from_dlpack(value)
    if hasattr(value, "__cuda_array_interface__"):
        return cupy.asarray(value)
    return cupy.asarray(np.asarray(value))


def placement(**arrays: Any) -> str:
    """HOST or DEVICE for a call's named arguments; a ``ValueError`` naming them if they mix."""
    placed = {name: where(value) for name, value in arrays.items() if value is not None}
    sides = {side for side in placed.values() if side is not None}
    if len(sides) > 1:
        host = sorted(name for name, side in placed.items() if side == HOST)
        device = sorted(name for name, side in placed.items() if side == DEVICE)
        raise ValueError(
            f"arguments on different devices: {', '.join(device)} on the GPU but "
            f"{', '.join(host)} on the CPU"
        )
    return sides.pop() if sides else HOST


def convert(**arrays: Any) -> tuple[str, dict[str, Any]]:
    """Bring named arguments to one side: ``(HOST, numpy arrays)`` or ``(DEVICE, cupy arrays)``.

    Plain sequences follow the arrays; ``None`` passes through. A mix of host and device arrays,
    or device arrays on different GPUs, is a ``ValueError`` naming the arguments.
    """
    side = placement(**arrays)
    move = to_device if side == DEVICE else to_host
    converted = {name: None if value is None else move(value) for name, value in arrays.items()}
    if side == DEVICE:
        devices = {name: a.device.id for name, a in converted.items() if a is not None}
        if len(set(devices.values())) > 1:
            raise ValueError(f"device arrays on different GPUs: {devices}")
    return side, converted


def place(stream: Any, **arrays: Any) -> tuple[Any, dict[str, Any]]:
    """One call's arguments and stream: ``(None, numpy arrays)`` or ``(CuPy stream, cupy arrays)``.

    Device arguments are imported for the stream the kernels will run on (see ``cuda_stream``);
    a ``stream`` with host arrays is a ``ValueError``, since nothing would run on it.
    """
    if placement(**arrays) == HOST:
        if stream is not None:
            raise ValueError("stream is only for GPU arrays, but the arguments are on the CPU")
        return None, convert(**arrays)[1]
    kernels_stream = cuda_stream(stream)
    with kernels_stream:
        return kernels_stream, convert(**arrays)[1]


class _StreamHandle:
    """A raw ``cudaStream_t`` in the CUDA stream protocol (for ``Stream.from_external``)."""

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return 0, self.handle


@lru_cache(maxsize=64)
def _external_stream(handle: int):
    """A CuPy stream for a foreign handle, made once per handle (the wrapper owns nothing)."""
    cupy = _cupy()
    if handle == 0:
        return cupy.cuda.Stream.null
    if hasattr(cupy.cuda.Stream, "from_external"):  # CuPy >= 14
        return cupy.cuda.Stream.from_external(_StreamHandle(handle))
    return cupy.cuda.ExternalStream(handle)


def cuda_stream(stream: Any = None):
    """The CuPy stream kernels run on: CuPy's current one, or the given CuPy/PyTorch stream.

    Accepts a CuPy stream, a ``torch.cuda.Stream``, or any object in the CUDA stream protocol
    (``__cuda_stream__``); anything else is a ``TypeError`` naming ``stream``.
    """
    cupy = _cupy()
    if stream is None:
        return cupy.cuda.get_current_stream()
    if isinstance(stream, cupy.cuda.Stream | cupy.cuda.ExternalStream):
        return stream
    if hasattr(stream, "__cuda_stream__"):
        handle = stream.__cuda_stream__()[1]
    else:
        handle = getattr(stream, "cuda_stream", None)  # torch streams before the protocol
    if isinstance(handle, bool) or not isinstance(handle, int):
        raise TypeError(
            f"stream must be a CuPy or torch CUDA stream (or have __cuda_stream__), "
            f"got {type(stream).__name__}"
        )
    return _external_stream(handle)
