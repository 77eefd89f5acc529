"""The one registry of live objects behind integer handles (``runtime/handles.py``): held
weakly, and a handle another process made is refused by name."""

from __future__ import annotations

import gc
import os

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


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_forked_child_draws_its_own_handles_and_keeps_its_parents():
    """A child made by ``fork()`` registers under a new tag (its handles never equal its
    parent's); the parent's handles from before the fork resolve to the child's copies, and
    one the parent makes after the fork is refused there as another process's."""
    before = Target()
    inherited = handles.register(before)
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # the child: report its handles, then leave without pytest's teardown
        try:
            new = Target()
            own = handles.register(new)
            assert handles.resolve(inherited) is before and handles.is_local(own)
            assert not handles.is_local(inherited + 1)  # what the parent registers next
            os.write(write, f"{own}".encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        own = int(pipe.read())
    os.waitpid(child, 0)
    later = Target()
    parents = handles.register(later)  # the child drew the same count
    assert parents == inherited + 1 and own != parents and not handles.is_local(own)
    with pytest.raises(RuntimeError, match=f"handle {own} was made by another process"):
        handles.resolve(own)
    assert handles.resolve(parents) is later and handles.resolve(inherited) is before
