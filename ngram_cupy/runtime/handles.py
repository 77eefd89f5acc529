"""Live objects behind integer handles, held weakly: the one registry through which the
registered torch ops and the XLA custom calls reach the object a graph was traced with.

A compiled graph, a ``torch.export`` program or a jitted XLA call holds a plain integer, never
the object, so schemas stay plain and a graph never keeps a table alive. Handles are unique
across processes: the high 31 bits are a random tag of this process, the low 32 a counter, so a
handle stored by another process (an exported program loaded elsewhere) is refused by name
rather than resolved to whatever this process registered under the same number.
"""

from __future__ import annotations

import itertools
import secrets
import threading
import weakref

_COUNTER_BITS = 32
_PROCESS_TAG = secrets.randbits(31) | 1  # never 0: a small handle is always foreign
_NEXT = itertools.count(1)
_LIVE: weakref.WeakValueDictionary[int, object] = weakref.WeakValueDictionary()
_LOCK = threading.Lock()


def register(target: object) -> int:
    """A new handle for ``target`` (held weakly: dropped with it), unique to this process."""
    with _LOCK:
        handle = _PROCESS_TAG << _COUNTER_BITS | next(_NEXT) & ((1 << _COUNTER_BITS) - 1)
        _LIVE[handle] = target
    return handle


def is_local(handle: int) -> bool:
    """Whether ``handle`` was made by this process (it may still be gone)."""
    return int(handle) >> _COUNTER_BITS == _PROCESS_TAG


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
