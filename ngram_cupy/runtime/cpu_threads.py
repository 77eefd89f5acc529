"""When a CPU kernel call uses threads: Numba's TBB layer where it loads, serial where threads lose.

A parallel kernel under Numba's ``omp`` layer hands each thread a fixed share and waits for all of
them at a barrier, so one thread descheduled by another program (or by torch's own thread pool)
stalls the call for a scheduler slice: ~8 ms against ~0.1 ms on one thread. The ``tbb`` layer
hands out work by stealing: a worker that is not running takes nothing, and the calling thread
does the rest itself. Measured on 2 cores, TBB calls stayed within noise of one thread with one
or both cores busy and beside torch, where ``omp`` took 17 to 380 times as long.

Stealing cannot take back the block a descheduled worker already holds, so on a host whose cores
are all taken a mid-sized call still waits for it now and then (32 x 512 tokens: 1.28x the
one-thread time with both cores busy). So each call also asks whether every core is taken, from
the kernel's count of runnable threads (``/proc/loadavg``, read at most every ``BUSY_RECHECK``
seconds), and runs serially below ``busy_min_work`` when they are.

So: the pip ``tbb`` package's library is loaded before Numba picks its layer (Numba looks for it
on the system library path only, and the wheel puts it in ``sys.prefix/lib``), and each call asks
``use_threads`` whether to run its parallel kernel. Under TBB that is a size threshold (a higher
one when every core is taken); under
``omp`` and ``workqueue`` (no TBB) a thread runs the parallel kernel only when no other thread is
running one (``workqueue`` aborts the process on concurrent launches, ``omp`` builds one full team
per calling thread) and only for work large enough to repay a stall.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
import time
from collections.abc import Iterator
from functools import cache
from importlib import metadata

import numba

# The library file Numba's TBB layer links to, per platform.
TBB_LIBRARY = {"win32": "tbb12.dll", "darwin": "libtbb.12.dylib"}.get(sys.platform,
                                                                        "libtbb.so.12")
# Without TBB a parallel call can stall a scheduler slice (~4-8 ms) when a core is taken:
# threads only for work that takes several times that on one thread.
STALL_SAFE_FACTOR = 32
# Seconds a reading of the runnable thread count stays current (a reading costs ~20 us).
BUSY_RECHECK = 0.02
RUNNABLE_FILE = "/proc/loadavg"

_launch_lock = threading.Lock()
_busy_reading = [-1.0, False]  # [monotonic time read, every core taken]


def tbb_library_path() -> str | None:
    """The TBB library installed by the pip ``tbb`` package, if any."""
    try:
        files = metadata.files("tbb") or []
    except metadata.PackageNotFoundError:
        return None
    for file in files:
        if file.name == TBB_LIBRARY:
            path = str(file.locate())
            return path if os.path.exists(path) else None
    return None


def load_tbb() -> bool:
    """Load the pip ``tbb`` library so that Numba's default layer search finds it.

    Numba opens it by its file name (``libtbb.so.12``), which resolves to a library already
    loaded under that name. A user's own ``NUMBA_THREADING_LAYER`` is left alone: this only
    makes TBB findable, Numba still chooses.
    """
    path = tbb_library_path()
    if path is None:
        return False
    try:
        ctypes.CDLL(path, mode=getattr(ctypes, "RTLD_GLOBAL", 0))
    except OSError:
        return False
    return True


@cache
def threading_layer() -> str:
    """The layer Numba runs parallel kernels on (``tbb``, ``omp`` or ``workqueue``); starts
    Numba's threads on first use."""
    numba.get_num_threads()  # launches the threading layer
    return numba.threading_layer()


def free_cores() -> float:
    """Cores this process may use, less the run queue the 1-minute load average reports."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (usable or 1) - os.getloadavg()[0] if hasattr(os, "getloadavg") else float(usable or 1)


def runnable_threads() -> int | None:
    """Threads runnable on the whole host now, the caller included (Linux); None elsewhere."""
    try:
        fd = os.open(RUNNABLE_FILE, os.O_RDONLY)
    except OSError:
        return None
    try:
        fields = os.read(fd, 256).split()
    finally:
        os.close(fd)
    try:
        return int(fields[3].split(b"/")[0])  # "running/total"
    except (IndexError, ValueError):
        return None


def cores_taken() -> bool:
    """Whether other threads hold every core this process may use (re-read every
    ``BUSY_RECHECK`` s; a race between threads only re-reads)."""
    now = time.monotonic()
    if now - _busy_reading[0] >= BUSY_RECHECK:
        runnable = runnable_threads()
        usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
        _busy_reading[:] = [now, runnable is not None and runnable > usable]
    return _busy_reading[1]


@contextlib.contextmanager
def use_threads(work: int, min_work: int, busy_min_work: int | None = None) -> Iterator[bool]:
    """Whether to run the parallel kernel for ``work`` items (``min_work``: the measured size
    below which threads cost more than they save; ``busy_min_work``: the same when every core is
    taken, where a descheduled worker can stall the call); held for the duration of the call."""
    if work < min_work or numba.get_num_threads() < 2:
        yield False
        return
    if threading_layer() == "tbb":
        yield not (min_work and busy_min_work and work < busy_min_work and cores_taken())
        return
    if min_work and (work < STALL_SAFE_FACTOR * min_work or free_cores() < 1):
        yield False  # a forced call (``min_work=0``) skips the size and load guesses
        return
    if not _launch_lock.acquire(blocking=False):
        yield False  # another thread runs a parallel kernel: this one runs serially beside it
        return
    try:
        yield True
    finally:
        _launch_lock.release()


load_tbb()
