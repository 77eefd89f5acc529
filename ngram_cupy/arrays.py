"""Array interop: accept NumPy, CuPy, PyTorch and any DLPack / CUDA-array-interface object.

Every public function converts its array arguments here, zero-copy, to NumPy (host) or CuPy
(device) arrays, and refuses a mix of host and device arrays. CuPy is imported only when a device
array is seen, so the CPU path never needs it.
"""

from __future__ import annotations

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
    if hasattr(value, "__cuda_array_interface__"):
        return DEVICE
    if hasattr(value, "__dlpack_device__"):
        kind = value.__dlpack_device__()[0]
        if kind == _DLPACK_CUDA:
            return DEVICE
        if kind in (_DLPACK_CPU, _DLPACK_CUDA_HOST):
            return HOST
        raise TypeError(f"unsupported DLPack device type {kind}")
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
    """A CuPy view of a device array (zero-copy), or a device copy of a host sequence."""
    cupy = _cupy()
    if isinstance(value, cupy.ndarray):
        return value
    if hasattr(value, "__cuda_array_interface__"):
        return cupy.asarray(value)
    if hasattr(value, "__dlpack__") and where(value) == DEVICE:
        return cupy.from_dlpack(value)
    return cupy.asarray(np.asarray(value))


def convert(**arrays: Any) -> tuple[str, dict[str, Any]]:
    """Bring named arguments to one side: ``(HOST, numpy arrays)`` or ``(DEVICE, cupy arrays)``.

    Plain sequences follow the arrays; ``None`` passes through. A mix of host and device arrays,
    or device arrays on different GPUs, is a ``ValueError`` naming the arguments.
    """
    sides = {name: where(value) for name, value in arrays.items() if value is not None}
    placed = {name: side for name, side in sides.items() if side is not None}
    if len(set(placed.values())) > 1:
        host = sorted(name for name, side in placed.items() if side == HOST)
        device = sorted(name for name, side in placed.items() if side == DEVICE)
        raise ValueError(
            f"arguments on different devices: {', '.join(device)} on the GPU but "
            f"{', '.join(host)} on the CPU"
        )
    side = next(iter(placed.values()), HOST)
    move = to_device if side == DEVICE else to_host
    converted = {name: None if value is None else move(value) for name, value in arrays.items()}
    if side == DEVICE:
        devices = {name: a.device.id for name, a in converted.items() if a is not None}
        if len(set(devices.values())) > 1:
            raise ValueError(f"device arrays on different GPUs: {devices}")
    return side, converted


def cuda_stream(stream: Any = None):
    """The CuPy stream kernels run on: CuPy's current one, or the given CuPy/torch stream."""
    cupy = _cupy()
    if stream is None:
        return cupy.cuda.get_current_stream()
    if isinstance(stream, cupy.cuda.Stream | cupy.cuda.ExternalStream):
        return stream
    handle = getattr(stream, "cuda_stream", stream)  # torch.cuda.Stream exposes .cuda_stream
    if not isinstance(handle, int):
        raise TypeError(f"stream must be a CuPy or torch CUDA stream, got {type(stream).__name__}")
    return cupy.cuda.ExternalStream(handle)
