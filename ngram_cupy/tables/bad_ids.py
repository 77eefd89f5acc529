"""Ids outside a table met by its GPU lookups, raised later, without the lookups waiting.

A GPU lookup never waits for its kernel: that would stall the host on every call and make a
prefetch hide nothing. The kernels (the gather and the fused ids + gather) take an atomic
minimum of the flat positions of the ids outside ``[0, total_rows)`` in one persistent uint64
word per table and GPU (``BadIds.word``), allocated and cleared outside any CUDA graph capture
by the table's first GPU lookup there (graph users warm up before capturing). After each launch
outside a capture the word is copied, on the lookup's stream, into a pinned host word, and an
event is recorded behind the copy (one event per stream, made once).

The IndexError surfaces at two points:

- ``poll`` (every GPU call on the table, before its own work): when the events of every stream
  that copied the word have completed (an event query, no wait) and the host word holds a
  position, it is raised, and the words cleared. So a bad id raises at the first call on the
  table after the GPU has run the lookup that met it.
- ``check`` (``EmbeddingTable.check()``): waits for the streams that used the word (and each
  GPU's current stream, where CUDA graphs were replayed), reads the device word and raises.
  That is the point that never misses: call it where a bad id must stop the program (after a
  step, at the end of a run).

A table with no word yet (its first GPU lookup is inside a capture) leaves captured ids
unchecked: a word made inside a capture would be cleared by every replay.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..runtime.backends import cupy_module
from ..runtime.used_streams import UsedStreams
from .row_ids import NO_BAD_WORD, first_bad


@dataclass
class DeviceWord:
    """One GPU's persistent word, its pinned host copy and the copies' events by stream."""

    word: Any  # uint64 [1] CuPy array: NO_BAD_WORD, or the first bad flat position noted
    host: np.ndarray  # uint64 [1] in pinned host memory: the word as last copied
    copies: dict[int, Any] = field(default_factory=dict)  # stream handle -> event after a copy
    streams: UsedStreams = field(default_factory=UsedStreams)  # streams that noted into it


def pinned_word(cupy) -> np.ndarray:
    """A uint64 ``[1]`` host array in page-locked memory (device copies into it are
    asynchronous), all bits set."""
    memory = cupy.cuda.alloc_pinned_memory(8)
    host = np.frombuffer(memory, np.uint64, 1)
    host[0] = NO_BAD_WORD
    return host


def bad_ids_error(position: int, total_rows: int) -> IndexError:
    """The IndexError of a GPU lookup that met an id outside the table at flat ``position``."""
    return IndexError(
        f"a GPU lookup of this table read an id outside the table's rows [0, {total_rows}) "
        f"(the first at flat position {position} of its [T, H] ids: token, head = "
        f"divmod({position}, H)). GPU lookups do not wait for their kernels: such an id is "
        "raised by the table's first call after the GPU ran that lookup, or by table.check(), "
        "which waits for it")


class BadIds:
    """A table's persistent bad-id words, one per GPU (see the module's docstring)."""

    def __init__(self) -> None:
        self.words: dict[int, DeviceWord] = {}

    def word(self, device: int, stream) -> Any:
        """The device word of ``device`` for a launch on ``stream``: made and cleared on
        ``stream`` the first time (outside a capture); None inside a capture before that."""
        if device not in self.words:
            if stream.is_capturing():
                return None
            cupy = cupy_module()
            with cupy.cuda.Device(device), stream:
                self.words[device] = DeviceWord(cupy.full(1, NO_BAD_WORD, np.uint64),
                                                pinned_word(cupy))
        return self.words[device].word

    def noted(self, device: int, stream) -> None:
        """A kernel on ``stream`` noted into the word of ``device``: copy it to the host word
        behind the kernel and record the stream's event after the copy (nothing in a capture:
        a replay's ids surface at the next copy, or ``check``)."""
        entry = self.words.get(device)
        if entry is None or stream.is_capturing():
            return
        cupy = cupy_module()
        with cupy.cuda.Device(device):
            runtime = cupy.cuda.runtime  # an asynchronous copy into page-locked memory
            runtime.memcpyAsync(entry.host.ctypes.data, entry.word.data.ptr, 8,
                                runtime.memcpyDeviceToHost, stream.ptr)
            if stream.ptr not in entry.copies:
                entry.copies[stream.ptr] = cupy.cuda.Event(disable_timing=True)
            entry.copies[stream.ptr].record(stream)
        entry.streams.add(stream)

    def poll(self, total_rows: int, stream) -> None:
        """Raise (once) a bad id already copied to the host: only when every copy is done (an
        event query; no wait), and the words cleared (``_clear``). Not
        while ``stream`` captures a CUDA graph (an event query there would break the capture)."""
        if stream.is_capturing():
            return
        for device, entry in self.words.items():
            if not entry.copies or not all(event.done for event in entry.copies.values()):
                continue
            position = first_bad(entry.host)
            if position >= 0:
                self._clear(device, entry)
                raise bad_ids_error(position, total_rows)

    def check(self, total_rows: int) -> None:
        """Wait for every stream that noted into a word (and each GPU's current stream: CUDA
        graph replays), then raise (once) the first bad id a word holds. A table no GPU lookup
        used has no word: nothing to wait for, and CuPy need not be installed."""
        if not self.words:
            return
        cupy = cupy_module()
        for device, entry in self.words.items():
            with cupy.cuda.Device(device):
                current = cupy.cuda.get_current_stream()
                entry.streams.synchronize()
                position = first_bad(entry.word.get(stream=current))
                if position >= 0:
                    self._clear(device, entry)
                    raise bad_ids_error(position, total_rows)

    @staticmethod
    def _clear(device: int, entry: DeviceWord) -> None:
        """Reset the device word and the host copy. The word is filled on ``device``'s current
        stream once every copy of it is done (their events, waited for device-side): a note a
        kernel on another stream made before its copy is copied, not erased unseen."""
        cupy = cupy_module()
        with cupy.cuda.Device(device):
            stream = cupy.cuda.get_current_stream()
            for event in entry.copies.values():
                stream.wait_event(event)
            with stream:
                entry.word.fill(NO_BAD_WORD)
        entry.host[0] = NO_BAD_WORD
