"""Node-wide shared-memory segments: one copy of a table's rows for every process of a node.

A segment is a file in ``/dev/shm`` (``NGRAM_CUPY_SHM_DIR`` elsewhere) named from a key that
identifies its rows (checkpoint files with their sizes and times, layer, row range, format; or a
content hash), ``ngram_cupy-<uid>-<digest>``, with a lock file ``<name>.lock`` beside it.

- The first process creates and fills it; the others attach. Every attach and detach runs under
  an exclusive ``flock`` of the lock file, and the fill runs inside it, so a process attaching
  while another fills waits for the fill to end: nobody maps a half-filled segment.
- The header (the first page) is written after the rows, its magic last: a segment without the
  magic is never taken as complete.
- Every attached process holds a shared ``flock`` of the segment file; the kernel drops it when
  the process ends, SIGKILL included. A process that can take the segment's lock exclusively
  is alone: on detach it removes the segment (it was the last user); on attach anything there
  is stale (its users are gone, perhaps mid-fill) and is emptied and filled again. Segments of
  other names left by killed processes are removed by the next attach of any segment
  (``remove_stale``).
- The rows start 2 MiB into the file, so that huge pages can back them.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import mmap
import os
import struct
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

from .host_memory import advise_huge_pages

SHM_DIR_ENV = "NGRAM_CUPY_SHM_DIR"
PREFIX = "ngram_cupy-"
LOCK_SUFFIX = ".lock"
MAGIC = b"NGCSHM01"
# magic, rows' bytes, key digest; the rows start at DATA_OFFSET (a huge page boundary).
HEADER = struct.Struct("<8sQ32s")
DATA_OFFSET = 2 << 20
POLL_SECONDS = 0.005


def shm_directory(directory: str | os.PathLike | None = None) -> Path:
    """Where segments live: ``directory``, else ``$NGRAM_CUPY_SHM_DIR``, else ``/dev/shm``."""
    return Path(directory if directory is not None
                else os.environ.get(SHM_DIR_ENV, "/dev/shm"))


def key_digest(key: str) -> bytes:
    """The 32-byte digest of a segment key."""
    return hashlib.sha256(key.encode()).digest()


def segment_name(key: str) -> str:
    """The file name of the segment of ``key``: this user's prefix and the key's digest."""
    return f"{PREFIX}{os.getuid()}-{key_digest(key).hex()[:32]}"


def own_segments(directory: str | os.PathLike | None = None) -> list[Path]:
    """This user's segment files (not their lock files) in the directory."""
    folder = shm_directory(directory)
    mine = f"{PREFIX}{os.getuid()}-"
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    return sorted(folder / name for name in names
                  if name.startswith(mine) and not name.endswith(LOCK_SUFFIX))


def _open(path: Path, flags: int) -> int:
    """``os.open`` with a permission error that names the file."""
    try:
        return os.open(path, flags | os.O_CLOEXEC, 0o600)
    except PermissionError as error:
        raise PermissionError(error.errno, f"no permission to open the shared-memory segment "
                              f"file {path} ({error.strerror}): another user's segment, or a "
                              f"directory this user cannot write (set {SHM_DIR_ENV})") from None


def _try_flock(fd: int, operation: int) -> bool:
    """A non-blocking ``flock``: whether it was granted."""
    try:
        fcntl.flock(fd, operation | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


@contextlib.contextmanager
def creation_lock(lock_path: Path, timeout: float | None = None,
                  blocking: bool = True) -> Iterator[bool]:
    """Hold the exclusive lock of a segment's lock file (made if absent); yields False when
    ``blocking=False`` and another process holds it. A lock file removed by its holder
    meanwhile is opened again, so two processes never hold two files of one name."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        fd = _open(lock_path, os.O_RDWR | os.O_CREAT)
        try:
            while not _try_flock(fd, fcntl.LOCK_EX):
                if not blocking:
                    yield False
                    return
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"waited {timeout} s for the shared-memory segment lock "
                                       f"{lock_path} (another process is filling it)")
                time.sleep(POLL_SECONDS)
            try:
                same = os.stat(lock_path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                yield True
                return
        finally:
            os.close(fd)  # drops the lock


def _remove(path: Path) -> None:
    """Remove a segment file and its lock file (the caller holds both locks)."""
    for file in (path, path.with_name(path.name + LOCK_SUFFIX)):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(file)


def remove_stale(directory: str | os.PathLike | None = None) -> list[str]:
    """Remove this user's segments that no process holds (their users were killed); return
    their paths. Segments being attached or filled right now are left alone."""
    removed = []
    for path in own_segments(directory):
        with creation_lock(path.with_name(path.name + LOCK_SUFFIX), blocking=False) as held:
            if not held:
                continue
            try:
                fd = _open(path, os.O_RDWR)
            except FileNotFoundError:
                continue
            try:
                if _try_flock(fd, fcntl.LOCK_EX):
                    _remove(path)
                    removed.append(str(path))
            finally:
                os.close(fd)
    return removed


def free_bytes(directory: Path) -> int:
    """Bytes an unprivileged writer may still allocate in the directory's file system."""
    stat = os.statvfs(directory)
    return stat.f_bavail * stat.f_frsize


class Segment:
    """One attached segment: ``memory``, a shared read-write mapping of exactly its rows'
    ``nbytes``; ``created`` (this process filled it) and ``seconds`` (the fill's or the
    attach's wall time, waiting included). ``close()`` detaches, removing the segment when this
    was its last user; interpreter exit closes it too."""

    def __init__(self, path: Path, fd: int, memory: mmap.mmap, nbytes: int, created: bool,
                 seconds: float):
        self.path, self.nbytes, self.memory = path, nbytes, memory
        self.created, self.seconds = created, seconds
        self._finalizer = weakref.finalize(self, _detach, path, fd)

    @property
    def attached(self) -> bool:
        """Whether this process still holds the segment."""
        return self._finalizer.alive

    def close(self) -> None:
        """Detach (the mapping stays readable while views of it live)."""
        self._finalizer()


def _detach(path: Path, fd: int) -> None:
    """Drop this process's hold of a segment; remove it when nobody else holds it."""
    try:
        with creation_lock(path.with_name(path.name + LOCK_SUFFIX)):
            if _try_flock(fd, fcntl.LOCK_EX) and _same_file(path, fd):
                _remove(path)
    finally:  # the mapping's duplicate descriptor shares the lock: unlock, not just close
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _same_file(path: Path, fd: int) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def _read_header(fd: int) -> tuple[bytes, int, bytes]:
    """The header fields of an open segment file (zeros when it is shorter than a header)."""
    data = os.pread(fd, HEADER.size, 0)
    return HEADER.unpack(data) if len(data) == HEADER.size else (b"", 0, b"")


def _map(fd: int, nbytes: int) -> mmap.mmap:
    """The segment's rows, mapped shared and writable (``cudaHostRegister`` needs write)."""
    return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED,
                     prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=DATA_OFFSET)


def attach(key: str, nbytes: int, fill: Callable[[mmap.mmap], None], *,
           directory: str | os.PathLike | None = None, huge_pages: bool | None = None,
           timeout: float | None = None) -> Segment:
    """The segment of ``key`` holding ``nbytes`` bytes of rows: attached when another process
    made it (waiting for its fill to end), else created here, with ``fill(memory)`` writing
    the rows. Errors (no room, a same-named segment with other contents, no permission, or
    ``fill`` raising) leave no segment behind."""
    if nbytes <= 0:
        raise ValueError(f"nbytes must be positive, got {nbytes}")
    folder = shm_directory(directory)
    if not folder.is_dir():
        raise FileNotFoundError(errno.ENOENT, f"the shared-memory directory {folder} does not "
                                f"exist (set {SHM_DIR_ENV})")
    remove_stale(folder)
    path = folder / segment_name(key)
    digest = key_digest(key)
    began = time.perf_counter()
    with creation_lock(path.with_name(path.name + LOCK_SUFFIX), timeout):
        fd = _open(path, os.O_RDWR | os.O_CREAT)
        try:
            if _try_flock(fd, fcntl.LOCK_EX):  # nobody holds it: new, or stale
                memory = _create(path, fd, nbytes, digest, fill, huge_pages)
                created = True
            else:
                memory = _join(path, fd, nbytes, digest)
                created = False
        except BaseException:
            os.close(fd)
            raise
        return Segment(path, fd, memory, nbytes, created, time.perf_counter() - began)


def _create(path: Path, fd: int, nbytes: int, digest: bytes,
            fill: Callable[[mmap.mmap], None], huge_pages: bool | None) -> mmap.mmap:
    """Empty the file, check the room, fill the rows, write the header; then hold it shared.
    On any error the file is removed (this process holds both locks: nobody else has it)."""
    try:
        os.ftruncate(fd, 0)  # a stale segment's pages go first
        free = free_bytes(path.parent)
        if nbytes > free:
            raise OSError(errno.ENOSPC, f"the shared-memory segment needs {nbytes:,} bytes but "
                          f"{path.parent} has {free:,} bytes free: enlarge it (e.g. docker "
                          f"--shm-size) or use placement 'pinned' / 'mmap'")
        os.ftruncate(fd, DATA_OFFSET + nbytes)
        try:
            os.posix_fallocate(fd, DATA_OFFSET, nbytes)  # reserve now: no SIGBUS mid-fill
        except OSError as error:
            raise OSError(error.errno, f"could not reserve {nbytes:,} bytes in {path.parent} "
                          f"for a shared-memory segment ({error.strerror})") from None
        memory = _map(fd, nbytes)
        advise_huge_pages(memory, huge_pages)
        fill(memory)
        memory.flush()
        os.pwrite(fd, HEADER.pack(b"\0" * 8, nbytes, digest), 0)
        os.pwrite(fd, MAGIC, 0)  # last: the segment is complete
        fcntl.flock(fd, fcntl.LOCK_SH)
        return memory
    except BaseException:
        _remove(path)
        raise


def _join(path: Path, fd: int, nbytes: int, digest: bytes) -> mmap.mmap:
    """Map a segment other processes hold, after checking it holds these rows."""
    magic, size, held = _read_header(fd)
    if magic != MAGIC or size != nbytes or held != digest \
            or os.fstat(fd).st_size != DATA_OFFSET + nbytes:
        raise ValueError(f"the shared-memory segment {path} is in use but holds other contents "
                         f"({'incomplete' if magic != MAGIC else f'{size:,} bytes'}, not these "
                         f"{nbytes:,}): remove it once its users are gone")
    if not _try_flock(fd, fcntl.LOCK_SH):
        raise RuntimeError(f"could not share the lock of {path}")  # no EX holder outside the lock
    return _map(fd, nbytes)


def resident_bytes(path: str | os.PathLike, pid: int | str = "self") -> tuple[int, int]:
    """``(Rss, Pss)`` in bytes of a process's mappings of the file ``path``, from
    ``/proc/<pid>/smaps``: Rss counts each shared page fully in every process, Pss splits it
    among the processes that map it (their Pss sums to the memory the file really takes)."""
    wanted = os.fspath(path)
    rss = pss = 0
    inside = False
    with open(f"/proc/{pid}/smaps") as smaps:
        for line in smaps:
            head = line.split(None, 1)[0]
            if not head.endswith(":"):  # a mapping's first line: range, perms, ..., path
                fields = line.split(None, 5)
                name = fields[5].strip() if len(fields) > 5 else ""
                inside = name in (wanted, f"{wanted} (deleted)")
            elif inside and head in ("Rss:", "Pss:"):
                value = int(line.split()[1]) * 1024
                rss, pss = (rss + value, pss) if head == "Rss:" else (rss, pss + value)
    return rss, pss
