"""The CUDA streams whose kernels used a resource, so that waiting for it waits for them alone.

``cudaDeviceSynchronize`` waits for every stream of the device (other models' work included) and
fails inside a global-mode CUDA graph capture, ruining it. A resource (pinned memory, a hot tier's
counters) remembers each stream that used it instead, and waits for those, refusing while one of
them is capturing a graph (a wait there would break the capture).
"""

from __future__ import annotations

from typing import Any


class UsedStreams:
    """CuPy streams (or any with ``ptr``, ``synchronize`` and ``is_capturing``), each kept once."""

    def __init__(self):
        self.streams: dict[int, Any] = {}  # by handle

    def add(self, stream: Any) -> None:
        """Remember a stream whose kernels use the resource."""
        self.streams.setdefault(stream.ptr, stream)

    def capturing(self) -> bool:
        """Whether one of the streams is capturing a CUDA graph now."""
        return any(stream.is_capturing() for stream in list(self.streams.values()))

    def synchronize(self) -> None:
        """Wait for the work queued on every stream so far, then forget them."""
        waited = list(self.streams.items())
        for _, stream in waited:
            stream.synchronize()
        for handle, _ in waited:
            self.streams.pop(handle, None)
