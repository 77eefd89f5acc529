"""The one registry of live objects behind integer handles (``runtime/handles.py``): held
weakly, and a handle another process made is refused by name."""

from __future__ import annotations

import gc

import pytest

from ngram_cupy.runtime import handles


class Target:
    """Something registered (a layer step, a bound call)."""


def test_a_handle_resolves_to_its_object_until_it_is_gone():
    target = Target()
    handle = handles.register(target)
    assert handles.resolve(handle) is target and handles.is_local(handle)
    assert handles.register(target) != handle  # a new handle each time
    del target
    gc.collect()
    with pytest.raises(RuntimeError, match=f"handle {handle} names no live layer"):
        handles.resolve(handle)


def test_a_handle_from_another_process_is_refused_by_name():
    """Handles carry a random tag of their process (in the bits above the counter), so one an
    exported program brought from elsewhere never names an object of this process."""
    target = Target()
    handle = handles.register(target)
    assert 0 < handle < 1 << 63  # torch's and XLA's int64
    for foreign in (handle ^ 1 << 40, handle & (1 << 32) - 1):
        assert not handles.is_local(foreign)
        with pytest.raises(RuntimeError, match=f"handle {foreign} was made by another process"):
            handles.resolve(foreign)
