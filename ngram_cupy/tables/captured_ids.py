"""Bad row ids found by lookups captured in CUDA graphs, raised later.

A GPU lookup outside a capture notes the first id outside ``[0, total_rows)`` in a fresh word
and reads it after the launch (``row_ids``); inside a capture that read would synchronise the
capturing stream, which breaks the capture. Captured gathers instead note into one persistent
word per table and GPU (``CapturedIds.word``), allocated and cleared outside any capture, by
the table's first GPU lookup there (graph users warm up before capturing). A table with no word
yet leaves captured ids unchecked: a word made inside a capture would be cleared by every replay,
and outlive a table made for one call (``dequantize``'s decoder). The word is read, and cleared,
by the table's next GPU lookup outside a capture on that GPU, or by
``EmbeddingTable.check_errors()``: that is when the IndexError of a replayed graph surfaces.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..runtime.backends import cupy_module
from .row_ids import NO_BAD_WORD, first_bad


class CapturedIds:
    """A table's persistent bad-id words, one per GPU, for gathers captured in CUDA graphs."""

    def __init__(self) -> None:
        self.words: dict[int, Any] = {}

    def word(self, device: int, stream) -> Any:
        """The word of ``device`` (a uint64 CuPy array of one element, all bits set when no bad
        id was seen), allocated and cleared on ``stream`` the first time."""
        if device not in self.words:
            cupy = cupy_module()
            with cupy.cuda.Device(device), stream:
                self.words[device] = cupy.full(1, NO_BAD_WORD, np.uint64)
        return self.words[device]

    def check(self, device: int, stream, total_rows: int) -> None:
        """Raise (once) the IndexError a captured gather of ``device`` recorded, reading its
        word on ``stream`` (outside a capture: this waits for the stream)."""
        word = self.words.get(device)
        if word is None:
            return
        position = first_bad(word.get(stream=stream))
        if position < 0:
            return
        cupy = cupy_module()
        with cupy.cuda.Device(device), stream:
            word.fill(NO_BAD_WORD)
        raise IndexError(f"a lookup captured in a CUDA graph read an id outside the table's rows "
                         f"[0, {total_rows}) (the first one at flat position {position} of its "
                         "ids, in a replay before this call); ids are checked in graphs by a "
                         "word read at the table's next lookup outside a capture, or by "
                         "table.check_errors()")

    def check_all(self, total_rows: int) -> None:
        """``check`` every GPU's word on its current stream (after the graphs' replays)."""
        if not self.words:
            return
        cupy = cupy_module()
        for device in list(self.words):
            with cupy.cuda.Device(device):
                self.check(device, cupy.cuda.get_current_stream(), total_rows)
