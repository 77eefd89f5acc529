"""Live objects behind integer handles, held weakly: the one registry through which the
registered torch ops and the XLA custom calls reach the object a graph was traced with.

A compiled graph, a ``torch.export`` program or a jitted XLA call holds a plain integer, never
the object, so schemas stay plain and a graph never keeps a table alive. Handles are unique
across processes: the high 31 bits are a random tag of this process, the low 32 a counter, so a
handle stored by another process (an exported program loaded elsewhere) is refused by name
rather than resolved to whatever this process registered under the same number.

A child made by ``fork()`` draws a new tag for what it registers (else its handles would equal
its parent's). The handles its parent made before the fork keep resolving in the child, to the
child's copies of their objects (a forked worker runs the graphs it inherited); one its parent
made after the fork is refused as another process's.
"""

from __future__ import annotations

import os
import secrets
import threading
import weakref

_COUNTER_BITS = 32
_LIVE: weakref.WeakValueDictionary[int, object] = weakref.WeakValueDictionary()


class _Tags:
    """This process's tag and counter, and the ancestors' tags with the counter at the fork."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.own = secrets.randbits(31) | 1  # never 0: a small handle is always foreign
        self.next = 1
        self.inherited: dict[int, int] = {}  # an ancestor's tag -> its counter at the fork

    def forked(self) -> None:
        """In a forked child: the parent's handles so far stay valid; new ones get a new tag."""
        self.lock = threading.Lock()  # another thread may have held it at the fork
        self.inherited[self.own] = self.next
        self.own, self.next = secrets.randbits(31) | 1, 1


_TAGS = _Tags()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_TAGS.forked)


def register(target: object) -> int:
    """A new handle for ``target`` (held weakly: dropped with it), unique to this process."""
    with _TAGS.lock:
        handle = _TAGS.own << _COUNTER_BITS | _TAGS.next & ((1 << _COUNTER_BITS) - 1)
        _TAGS.next += 1
        _LIVE[handle] = target
    return handle


def is_local(handle: int) -> bool:
    """Whether ``handle`` was made by this process, or by an ancestor before forking it (its
    object may still be gone)."""
    tag, counter = divmod(int(handle), 1 << _COUNTER_BITS)
    return tag == _TAGS.own or counter < _TAGS.inherited.get(tag, 0)


def resolve(handle: int) -> object:
    """The live object registered as ``handle``; a RuntimeError naming the handle when another
    process made it or its object is gone."""
    handle = int(handle)
    if not is_local(handle):
        raise RuntimeError(f"ngram_cupy handle {handle} was made by another process: a graph "
                           "or program holding it must be traced again in this process, over "
                           "this process's layers and tables")
    target = _LIVE.get(handle)  # a read needs no lock: every op call passes here
    if target is None:
        raise RuntimeError(f"ngram_cupy handle {handle} names no live layer: the object the "
                           "graph or jitted call was traced with is gone (garbage collected), "
                           "it outlived its module")
    return target
