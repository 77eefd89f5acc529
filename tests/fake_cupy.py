"""A CuPy stand-in with several GPUs, for the device-following logic on machines without one:
the current device (entered with ``cuda.Device``), streams that know their device, and a log."""

from __future__ import annotations

import types as pytypes


class FakeCupy:
    """``cuda.Device``, ``cuda.Stream``, ``cuda.ExternalStream``, ``cuda.Event`` and
    ``cuda.get_current_stream``, recording what happens in ``log``."""

    def __init__(self) -> None:
        self.current = 0
        self.log: list[tuple] = []
        cupy = self

        class Device:
            def __init__(self, device=None):
                self.id = cupy.current if device is None else int(device)

            def __enter__(self):
                self.previous, cupy.current = cupy.current, self.id
                cupy.log.append(("device", self.id))
                return self

            def __exit__(self, *exc):
                cupy.current = self.previous

        class Stream:
            def __init__(self, non_blocking=False, ptr=0x1000, device_id=None):
                self.ptr = ptr
                self.device_id = cupy.current if device_id is None else device_id
                cupy.log.append(("stream made", self.device_id))

            def __enter__(self):
                cupy.log.append(("stream", self.ptr, cupy.current))
                return self

            def __exit__(self, *exc):
                pass

        class ExternalStream(Stream):
            def __init__(self, ptr, device_id=-1):
                super().__init__(ptr=ptr, device_id=device_id)

        class Event:
            def __init__(self, disable_timing=False):
                cupy.log.append(("event made", cupy.current))

        self.cuda = pytypes.SimpleNamespace(
            Device=Device, Stream=Stream, ExternalStream=ExternalStream, Event=Event,
            get_current_stream=lambda: Stream(ptr=0x100 + cupy.current))
