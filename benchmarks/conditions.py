"""Load conditions for CPU benchmarks: where users run, not only an idle machine.

Each condition is a context manager that creates its load (busy-loop processes, a torch thread
multiplying matrices) and removes it on exit. ``one_thread`` runs a call on a single Numba thread
in the calling thread only, which is what ``NUMBA_NUM_THREADS=1`` would give.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import numba

SETTLE_SECONDS = 0.2  # let the load reach the scheduler before timing


def usable_cores() -> int:
    """Cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


@contextlib.contextmanager
def busy_processes(count: int) -> Iterator[None]:
    """``count`` other programs each spinning on a core."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        time.sleep(SETTLE_SECONDS)
        yield
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


@contextlib.contextmanager
def torch_beside() -> Iterator[None]:
    """A thread of this process running torch matrix products (torch's own thread pool)."""
    import torch

    stop = threading.Event()
    started = threading.Event()

    def work() -> None:
        a = torch.randn(1024, 1024)  # ~10 ms a product: the GIL changes hands rarely
        started.set()
        while not stop.is_set():
            torch.mm(a, a)

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    started.wait()
    try:
        time.sleep(SETTLE_SECONDS)
        yield
    finally:
        stop.set()
        thread.join()


@contextlib.contextmanager
def idle() -> Iterator[None]:
    """No load added."""
    yield


def torch_available() -> bool:
    """Whether torch can be imported (the ``beside torch`` condition needs it)."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def conditions() -> list[tuple[str, Callable[[], contextlib.AbstractContextManager]]]:
    """The four conditions: idle, one core busy, every core busy, torch in another thread."""
    found = [("idle", idle), ("1 core busy", lambda: busy_processes(1)),
             (f"all {usable_cores()} cores busy", lambda: busy_processes(usable_cores()))]
    if torch_available():
        found.append(("beside torch", torch_beside))
    return found


def one_thread(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` run with one Numba thread (in this thread only; restored after each call)."""

    def call() -> object:
        before = numba.get_num_threads()
        numba.set_num_threads(1)
        try:
            return fn()
        finally:
            numba.set_num_threads(before)

    return call
