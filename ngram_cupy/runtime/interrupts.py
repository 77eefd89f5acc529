"""SIGINT and SIGTERM stop a command wherever they arrive, even inside code that drops exceptions.

Numba's compiler calls back into Python through ctypes, which prints and discards an exception
raised there ("Exception ignored on calling ctypes callback function"): a Ctrl-C during a compile
would be lost and the command would finish and write its output. So the handler records the
signal as well as raising, and ``check`` (called between batches and before output is committed)
raises it again.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM)

_pending: list[int] = []  # signals received while ``honoured`` is active, oldest first


class Interrupted(KeyboardInterrupt):
    """A SIGINT or SIGTERM; ``exit_status`` is the shell's 128 + signal number."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.exit_status = 128 + signum


def _record_and_raise(signum: int, frame: object) -> None:
    """The handler: remember the signal, then unwind (so temporary files are removed)."""
    _pending.append(signum)
    raise Interrupted(signum)


def check() -> None:
    """Raise ``Interrupted`` if a signal arrived since ``honoured`` began, even a swallowed one."""
    if _pending:
        raise Interrupted(_pending[0])


@contextlib.contextmanager
def honoured() -> Iterator[None]:
    """Within the block SIGINT and SIGTERM raise ``Interrupted`` and are remembered for ``check``.

    Only the main thread can set handlers: elsewhere (a library caller's thread) nothing changes.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _pending.clear()
    previous = {signum: signal.signal(signum, _record_and_raise) for signum in SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        _pending.clear()
