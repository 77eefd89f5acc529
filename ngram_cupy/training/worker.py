"""Asynchronous row updates: one worker thread applies an optimizer's updates in issue order
while the caller goes on (the update kernels release the GIL), one update in flight at a time.
A refused update whose error no call collected by the end of the program is reported then."""

from __future__ import annotations

import atexit
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from ..runtime.cpu_threads import threading_layer

# Errors updates raised that no ``wait`` has raised yet (a forked child starts with none).
UNREPORTED: set[BaseException] = set()
os.register_at_fork(after_in_child=UNREPORTED.clear)


def run_noted(update: Callable[[], None]) -> None:
    """Run ``update`` on the worker, noting its error (if any) until a ``wait`` raises it."""
    try:
        update()
    except BaseException as error:
        UNREPORTED.add(error)
        raise


class ExitStatus:
    """Ends the process with ``status`` when deleted: held by this module, it is deleted as the
    interpreter tears its modules down, after every exit handler has run (an exit handler
    cannot set the status, and ``os._exit`` there would skip the handlers not yet run)."""

    def __init__(self, status: int) -> None:
        self.status, self.exit, self.streams = status, os._exit, (sys.stdout, sys.stderr)

    def __del__(self) -> None:
        for stream in self.streams:
            try:
                stream.flush()
            except (AttributeError, OSError, ValueError):
                pass  # gone or closed by then: nothing left to flush
        self.exit(self.status)


AT_TEARDOWN: list[ExitStatus] = []  # the status the process ends with, once armed


@atexit.register  # at import: it runs after the exit handlers of modules imported later
def report_unreported() -> None:
    """At the end of the program, a refused update nobody was told of is not dropped: its error
    goes to stderr (after the worker threads have ended), the other exit handlers run, and the
    process ends with status 1."""
    if not UNREPORTED:
        return
    for error in list(UNREPORTED):
        print(f"ngram_cupy: an asynchronous row update was refused and no later call reported "
              f"it (it changed nothing): {type(error).__name__}: {error}", file=sys.stderr)
    AT_TEARDOWN.append(ExitStatus(1))


class UpdateWorker:
    """Runs each submitted update on a worker thread; an error it raised (the update changed
    nothing: its checks run before any row is written) surfaces once, at the next ``submit``,
    ``wait``, lookup or read of the table's rows (``EmbeddingTable.wait_for_updates``)."""

    def __init__(self) -> None:
        if threading_layer() == "workqueue":
            raise ValueError("asynchronous=True needs Numba's tbb or omp threading layer: its "
                             "update kernels run beside the caller's, and the workqueue layer "
                             "aborts the process on concurrent parallel kernels (pip install "
                             "tbb)")
        self._executor: ThreadPoolExecutor | None = None
        self._pid = os.getpid()  # the process whose thread the executor's is
        self._future: Future | None = None
        self._lock = threading.Lock()

    def submit(self, update: Callable[[], None]) -> None:
        """Wait for the previous update (raising its error, if any), then start ``update``."""
        self.wait()
        with self._lock:
            if self._executor is None or self._pid != os.getpid():  # a forked child: no worker
                self._executor = ThreadPoolExecutor(max_workers=1,
                                                    thread_name_prefix="ngram-update")
                self._pid = os.getpid()
            self._future = self._executor.submit(run_noted, update)

    @property
    def busy(self) -> bool:
        """Whether an update is running or queued."""
        future = self._future
        return future is not None and not future.done() and self._pid == os.getpid()

    def settle(self) -> None:
        """Wait until the pending update, if any, has finished; raise nothing."""
        future = self._future
        if future is not None and self._pid == os.getpid():
            future.exception()

    def wait(self) -> None:
        """Wait until the pending update, if any, has finished; re-raise its error once."""
        future = self._future
        if future is None:
            return
        if self._pid != os.getpid():  # forked while it ran: its thread is not in this process
            self._future = None
            return
        error = future.exception()
        with self._lock:
            if self._future is not future:
                return  # another thread took it (and its error)
            self._future = None
        if error is not None:
            UNREPORTED.discard(error)
            raise error

    def close(self) -> None:
        """Wait for the pending update (raising its error) and stop the thread."""
        try:
            self.wait()
        finally:
            if self._executor is not None and self._pid == os.getpid():
                self._executor.shutdown(wait=True)
            self._executor = None
