"""Python callables run in stream order by CUDA host functions, safe under CUDA graph replay.

CuPy's ``Stream.launch_host_func`` hands CUDA a trampoline that drops its reference to the
Python callable each time it runs: a host function captured in a CUDA graph runs once per
replay, so the second replay would call freed memory (cuda-python's ``cuLaunchHostFunc``
frees its own wrapper after each call likewise). Here one C function pointer made once for
the process (``run_host_call``) is enqueued with ``cuLaunchHostFunc`` from the driver library
directly, its user data a key into ``CALLS``: the owner of a key keeps the callable until it
lets it go (``forget``), and a call enqueued outside a capture lets it go after its one run.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
from collections.abc import Callable

CALLS: dict[int, tuple[Callable[[], None], bool]] = {}  # key: (callable, kept after a run)
KEYS = itertools.count(1)


@ctypes.CFUNCTYPE(None, ctypes.c_void_p)
def run_host_call(key: int | None) -> None:
    """The host function CUDA runs: the callable of ``key`` (dropped after a one-off run)."""
    call, kept = CALLS.get(key or 0, (None, True))
    if not kept:
        CALLS.pop(key, None)
    if call is not None:
        call()


@functools.cache
def driver_library() -> ctypes.CDLL:
    """The CUDA driver library (its ``cuLaunchHostFunc``)."""
    return ctypes.CDLL("libcuda.so.1")


def launch_host_call(stream, key: int) -> None:
    """Enqueue ``run_host_call(key)`` on ``stream`` (a CuPy stream: its ``ptr``)."""
    result = driver_library().cuLaunchHostFunc(ctypes.c_void_p(stream.ptr), run_host_call,
                                               ctypes.c_void_p(key))
    if result:
        raise RuntimeError(f"cuLaunchHostFunc failed with CUDA error {result}")


def enqueue(stream, call: Callable[[], None], kept: bool) -> int:
    """Run ``call`` in ``stream``'s order; ``kept``: the caller keeps it (a capture replays it)
    until ``forget``; else it is dropped after its run. The key."""
    key = next(KEYS)
    CALLS[key] = (call, kept)
    try:
        launch_host_call(stream, key)
    except BaseException:
        CALLS.pop(key, None)
        raise
    return key


def forget(keys: list[int]) -> None:
    """Drop the callables of ``keys`` (no graph that captured them replays any more)."""
    for key in keys:
        CALLS.pop(key, None)
