"""Ids outside the table met by GPU gathers captured in CUDA graphs: no host read during the
capture, the IndexError at the next gather outside a capture or at ``check_errors``.

Driven on the CPU: a stand-in CuPy whose "kernel" notes the first bad position into the word it
is given, and a stream whose capture can be switched on.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
from fake_cupy import FakeCupy

from ngram_cupy.tables import captured_ids, gather_cupy
from ngram_cupy.tables.row_ids import NO_BAD_WORD

TOTAL_ROWS = 10


class Word:
    """A one-element uint64 device word; ``get`` is the host read (a stream sync)."""

    def __init__(self, log, value):
        self.log, self.value = log, np.array([value], np.uint64)

    def get(self, stream=None):
        self.log.append("read")
        return self.value.copy()

    def fill(self, value):
        self.value[:] = value


class Stream:
    capturing = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def is_capturing(self):
        return self.capturing


class Ids(np.ndarray):
    """Host ids that say which GPU they are on, as CuPy arrays do."""

    device = types.SimpleNamespace(id=0)


@pytest.fixture
def gpu(monkeypatch):
    """The fake CuPy, its log, and a capturable stream, patched into the GPU gather."""
    cupy = FakeCupy()
    cupy.full = lambda shape, value, dtype: Word(cupy.log, value)
    cupy.log.clear()
    for module in (gather_cupy, captured_ids):
        monkeypatch.setattr(module, "cupy_module", lambda: cupy)

    def plan(table, code, row_start, scale, ids, *args):
        total_rows, bad = args[-2:]  # launch_plan's last two parameters
        return gather_cupy.Launch("gather", 1, 1, (ids, total_rows, bad))

    def kernel(grid, block, args, stream):
        ids, total_rows, bad = args
        outside = np.flatnonzero((ids < 0) | (ids >= total_rows))
        if outside.size and isinstance(bad, Word):
            bad.value[0] = min(int(bad.value[0]), int(outside[0]))

    monkeypatch.setattr(gather_cupy, "launch_plan", plan)
    monkeypatch.setattr(gather_cupy, "_kernel", lambda name, device: kernel)
    return cupy, Stream()


def captured_gather(ids, stream, captured):
    ids = np.asarray(ids, np.int64).reshape(-1, 2).view(Ids)
    table = np.zeros((TOTAL_ROWS, 1), np.float32)  # the whole table: no shard to speak of
    gather_cupy.gather_rows(table, 0, 0, 1.0, ids, None, 0, stream=stream,
                            total_rows=TOTAL_ROWS, captured=captured)


def test_a_captured_bad_id_surfaces_at_the_next_gather_outside_the_capture(gpu):
    cupy, stream = gpu
    captured = captured_ids.CapturedIds()
    captured_gather([1, 2, 3, 4], stream, captured)  # a warm-up: the persistent word made outside
    assert 0 in captured.words
    cupy.log.clear()
    stream.capturing = True
    captured_gather([1, 2, 3, TOTAL_ROWS + 5], stream, captured)
    assert "read" not in cupy.log  # nothing waits for the capturing stream
    stream.capturing = False
    with pytest.raises(IndexError, match=r"captured in a CUDA graph .* \[0, 10\) .*position 3"):
        captured_gather([1, 2, 3, 4], stream, captured)
    assert captured.words[0].value[0] == NO_BAD_WORD  # raised once
    captured_gather([1, 2, 3, 4], stream, captured)


def test_a_bad_id_outside_a_capture_is_named_at_once(gpu):
    _, stream = gpu
    captured = captured_ids.CapturedIds()
    with pytest.raises(IndexError, match=r"ids\[1, 0\] = -3 is outside"):
        captured_gather([1, 2, -3, 4], stream, captured)
    captured.check_all(TOTAL_ROWS)  # the persistent word saw nothing


def test_check_errors_reads_every_gpus_word(gpu):
    cupy, stream = gpu
    captured = captured_ids.CapturedIds()
    captured_gather([1, 2, 3, 4], stream, captured)
    stream.capturing = True
    captured_gather([1, 2, 3, 40], stream, captured)
    with pytest.raises(IndexError, match="position 3"):
        captured.check_all(TOTAL_ROWS)
    captured.check_all(TOTAL_ROWS)


@pytest.mark.parametrize("captured", [None, captured_ids.CapturedIds()], ids=["none", "fresh"])
def test_without_a_word_captured_gathers_leave_ids_unchecked(gpu, captured):
    """No word is made inside a capture (every replay would clear it, and a table made for one
    call would leave the graph writing into memory it freed)."""
    cupy, stream = gpu
    stream.capturing = True
    captured_gather([1, 2, 3, 40], stream, captured)
    assert "read" not in cupy.log and (captured is None or not captured.words)
