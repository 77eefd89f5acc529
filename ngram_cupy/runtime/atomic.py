"""Atomic file writes: a recognisable temporary beside the target, renamed over it when complete.

Every temporary file this library writes is named ``.ngram-cupy-tmp-<host>-<pid>-<random>-<name>``
(``<host>`` a short hash of the host name). A run killed mid-write (SIGKILL, power loss) leaves
it behind; the next write into the same folder removes such files (and folders) when they are
stale: written by a process of this host that no longer runs, or untouched for
``STALE_SECONDS``.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import secrets
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path

TEMP_PREFIX = ".ngram-cupy-tmp-"
# A temporary not modified for this long is stale whoever wrote it (another host, a reused pid).
STALE_SECONDS = 24 * 3600
_TEMP_NAME = re.compile(re.escape(TEMP_PREFIX) + r"(?P<host>[0-9a-f]{8})-(?P<pid>\d+)-[0-9a-f]{8}-")
_NAME_MAX = 255


def host_tag() -> str:
    """Eight hex digits naming this host, so a shared folder's temporaries are told apart."""
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def _process_alive(pid: int) -> bool:
    """Whether a process with this id runs on this host (any owner)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OverflowError:
        return False
    return True


def is_stale(path: str | os.PathLike, now: float | None = None) -> bool:
    """Whether ``path`` is one of our temporaries whose writer is gone (or that is very old)."""
    match = _TEMP_NAME.match(os.path.basename(path))
    if match is None:
        return False
    try:
        age = (time.time() if now is None else now) - os.lstat(path).st_mtime
    except FileNotFoundError:
        return False
    if age > STALE_SECONDS:
        return True
    return match["host"] == host_tag() and not _process_alive(int(match["pid"]))


def remove_stale_temporaries(folder: str | os.PathLike) -> list[str]:
    """Delete the stale temporaries in ``folder`` (see :func:`is_stale`), files and the folders
    a whole-folder write builds (``ngram-cupy quantize``); return their paths."""
    removed = []
    with contextlib.suppress(FileNotFoundError, NotADirectoryError), os.scandir(folder) as entries:
        for entry in entries:
            if not entry.name.startswith(TEMP_PREFIX) or entry.is_symlink() \
                    or not is_stale(entry.path):
                continue
            with contextlib.suppress(FileNotFoundError):
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path)
                else:
                    os.remove(entry.path)
                removed.append(entry.path)
    return removed


def temporary_name(final: str | os.PathLike) -> str:
    """A name for a temporary beside ``final`` (one file system, so the rename is atomic) that
    only this process would pick: the host, the pid and a random token."""
    final = Path(final)
    name = f"{TEMP_PREFIX}{host_tag()}-{os.getpid()}-{secrets.token_hex(4)}-{final.name}"
    return str(final.parent / name.encode()[:_NAME_MAX].decode(errors="ignore"))


def create_empty(path: str) -> bool:
    """Create ``path`` empty, readable as the umask allows any new file (``mkstemp``'s 0600
    would stick to the output); False when it exists already."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    except FileExistsError:
        return False
    return True


def usual_mode() -> int:
    """The permissions a new file gets under the current umask."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def discard(temporary: str) -> None:
    """Remove a temporary, whether or not it still exists."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(temporary)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[str]:
    """Yield a temporary path beside ``path``; when the block ends normally it replaces ``path``
    in one rename (with the usual permissions), otherwise it is removed. Stale temporaries in the
    folder are removed first."""
    final = Path(path)
    folder = final.parent
    if not folder.is_dir():
        raise FileNotFoundError(errno.ENOENT, "output folder does not exist", str(folder))
    if final.is_dir():
        raise IsADirectoryError(errno.EISDIR, "output is a directory", str(final))
    if final.exists() and not final.is_file():
        raise FileExistsError(errno.EEXIST, "output exists and is not a regular file (a device, "
                              "FIFO or socket would be replaced)", str(final))
    remove_stale_temporaries(folder)
    # Named before it exists and created inside the try: a signal that lands just after the
    # file appears (when a watcher sees it) still removes it. Only this process picks the name.
    temporary = temporary_name(final)
    try:
        while not create_empty(temporary):
            temporary = temporary_name(final)
        yield temporary
        os.chmod(temporary, usual_mode())
        os.replace(temporary, final)
    except BaseException:
        discard(temporary)
        raise
