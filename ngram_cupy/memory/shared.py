"""Node-wide shared-memory segments: one copy of a table's rows for every process of a node.

A segment is anonymous shared memory (``memfd_create``): no file names it, so the kernel frees
it when the last process holding its descriptor or a mapping of it ends, however it ends
(SIGKILL and the OOM killer included). Processes find each other through abstract-namespace
Unix socket names (``rendezvous``), which the kernel drops with their sockets too:

- ``<base>``, the creation name, ``base = ngram_cupy-<uid>-<scope>-<key digest>``: bound by the
  one process that creates and fills the segment. Others connect to it and wait; the creator
  hands them the descriptor once the rows are complete (or they see the connection close when
  it fails or dies, and try again: one of them creates it afresh).
- ``<base>.<pid>.<n>``, a holder name: each process holding the segment binds one, and a thread
  of it hands the descriptor to any process of this user that connects. A creator binds its
  holder name before it drops the creation name, so a later process always finds one of them.

Attaching tries the listed holders first, then the creation name. A dead process's names are
gone at once, so nobody waits on it; a live creator is waited for (``timeout``); a live holder
that does not answer within ``HANDOVER_SECONDS`` is an error naming its pid. The segment is
sealed against resizing (so no process can shrink it under the others' mappings) and mapped
shared and writable in every process. Where anonymous shared memory cannot hold the rows (less
memory available than the segment needs, ``memfd_create`` missing or refused), the rows go to
private memory with a ``SharedMemoryFallbackWarning`` naming the sizes, or, strict, an
``OSError``. ``NGRAM_CUPY_SHM_DIR`` scopes the names: processes share segments when they see the
same value (default ``/dev/shm``); nothing is written there.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import itertools
import mmap
import os
import socket
import struct
import time
import warnings
import weakref
from collections.abc import Callable

from . import rendezvous
from .anonymous import advise_huge_pages, anonymous_memory

SHM_DIR_ENV = "NGRAM_CUPY_SHM_DIR"
STRICT_ENV = "NGRAM_CUPY_SHM_STRICT"
TIMEOUT_ENV = "NGRAM_CUPY_SHM_TIMEOUT"
PREFIX = "ngram_cupy-"
MAGIC = b"NGCSHM02"
MESSAGE = struct.Struct("<8sQ32s")  # magic, rows' bytes, key digest: sent with the descriptor
HANDOVER_SECONDS = 5.0  # a live holder's thread answers in milliseconds
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
NO_ROOM = (errno.ENOSPC, errno.ENOMEM, errno.ENOSYS, errno.EPERM, errno.EACCES, errno.EMFILE,
           errno.ENFILE)


class SharedMemoryFallbackWarning(RuntimeWarning):
    """The rows did not fit in shared memory and were put in this process's private memory."""


class SharedMemoryUnavailable(OSError):
    """Shared memory could not hold a segment (too little memory, or no ``memfd_create``)."""


def shm_directory(directory: str | os.PathLike | None = None) -> str:
    """The scope of segment names: ``directory``, else ``$NGRAM_CUPY_SHM_DIR``, else
    ``/dev/shm`` (an absolute path; only its name matters)."""
    return os.path.abspath(directory if directory is not None
                           else os.environ.get(SHM_DIR_ENV, "/dev/shm"))


def key_digest(key: str) -> bytes:
    """The 32-byte digest of a segment key."""
    return hashlib.sha256(key.encode()).digest()


def name_prefix(directory: str | os.PathLike | None = None) -> str:
    """The start of every segment name of this user in the scope."""
    scope = hashlib.sha256(shm_directory(directory).encode()).hexdigest()[:8]
    return f"{PREFIX}{os.getuid()}-{scope}-"


def segment_name(key: str, directory: str | os.PathLike | None = None) -> str:
    """The creation name of the segment of ``key`` (its holders' names extend it)."""
    return name_prefix(directory) + key_digest(key).hex()[:32]


def own_segments(directory: str | os.PathLike | None = None) -> list[str]:
    """This user's segments in the scope that a live process creates or holds (their names)."""
    return sorted({name.split(".", 1)[0]
                   for name in rendezvous.bound_names(name_prefix(directory))})


def holders(name: str) -> list[tuple[str, int]]:
    """``(holder name, pid)`` of every process holding the segment ``name``."""
    found = [(held, held.split(".")) for held in rendezvous.bound_names(name + ".")]
    return [(held, int(parts[1])) for held, parts in found
            if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit()]


def strict_wanted(strict: bool | None = None) -> bool:
    """``strict`` when given, else ``$NGRAM_CUPY_SHM_STRICT`` (off unless ``1``/``true``/...)."""
    if strict is not None:
        return bool(strict)
    return os.environ.get(STRICT_ENV, "0").strip().lower() in ("1", "true", "yes", "on")


def wait_seconds(timeout: float | None = None) -> float | None:
    """``timeout`` when given, else ``$NGRAM_CUPY_SHM_TIMEOUT``, else None (as long as the
    creator lives)."""
    if timeout is None and os.environ.get(TIMEOUT_ENV, "").strip():
        timeout = float(os.environ[TIMEOUT_ENV])
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return timeout


def _meminfo_available() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _read_number(path: str) -> int | None:
    """An integer file of the cgroup file system (None when absent or ``max``)."""
    try:
        with open(path) as file:
            text = file.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _cgroup_headroom() -> int | None:
    """What this process's memory cgroup (v2, else v1) may still charge, where it has a limit."""
    try:
        with open("/proc/self/cgroup") as groups:
            lines = [line.rstrip("\n").split(":", 2) for line in groups]
    except OSError:
        return None
    for _, controllers, path in (fields for fields in lines if len(fields) == 3):
        if controllers == "":
            limit, used = "memory.max", "memory.current"
            folder = f"/sys/fs/cgroup{path}"
        elif "memory" in controllers.split(","):
            limit, used = "memory.limit_in_bytes", "memory.usage_in_bytes"
            folder = f"/sys/fs/cgroup/memory{path}"
        else:
            continue
        cap, current = _read_number(f"{folder}/{limit}"), _read_number(f"{folder}/{used}")
        if cap is not None and current is not None and cap < 1 << 60:
            return max(cap - current, 0)
    return None


def memory_available() -> int | None:
    """Bytes a new segment may take without pushing the node (or this process's memory cgroup)
    into the OOM killer: the smaller of ``MemAvailable`` and the cgroup's headroom (None where
    neither is known)."""
    known = [value for value in (_meminfo_available(), _cgroup_headroom()) if value is not None]
    return min(known) if known else None


class Holding:
    """What this process holds of a segment: its descriptor and the server handing it out."""

    def __init__(self, fd: int, server: rendezvous.Server):
        self.fd, self.server = fd, server
        HOLDINGS.add(self)

    def release(self) -> None:
        """Stop serving and close the descriptor (the mapping keeps the memory while it lives)."""
        if self.fd < 0:
            return
        HOLDINGS.discard(self)
        self.server.close()
        os.close(self.fd)
        self.fd = -1

    def forget(self) -> None:
        """In a forked child: close the copies of the socket and descriptor (the parent's
        serve); the child keeps only the mapping, if it inherited one."""
        HOLDINGS.discard(self)
        self.server.sock.close()
        os.close(self.fd)
        self.fd = -1


HOLDINGS: weakref.WeakSet[Holding] = weakref.WeakSet()


def _forget_in_child() -> None:
    """A forked child has none of the parent's server threads: its copies are closed."""
    for holding in list(HOLDINGS):
        holding.forget()


os.register_at_fork(after_in_child=_forget_in_child)


class Segment:
    """One attached segment: ``memory``, a shared read-write mapping of exactly its rows'
    ``nbytes`` (writes are seen by every process); ``created`` (this process filled it),
    ``seconds`` (the fill's or the attach's wall time, waiting included), ``shared`` (False for
    rows that fell back to private memory), ``name`` (its creation name) and ``path`` (the name
    its mapping has in ``/proc/<pid>/smaps``; None when private). ``close()`` detaches: the
    kernel frees the memory once no process holds or maps it; interpreter exit closes it too."""

    def __init__(self, name: str, memory: mmap.mmap, nbytes: int, created: bool, seconds: float,
                 holding: Holding | None):
        self.name, self.nbytes, self.memory = name, nbytes, memory
        self.created, self.seconds = created, seconds
        self.shared = holding is not None
        self.path = f"/memfd:{name}" if self.shared else None
        self._finalizer = weakref.finalize(self, holding.release if holding else int)

    @property
    def attached(self) -> bool:
        """Whether this process still holds the segment."""
        return self._finalizer.alive

    def close(self) -> None:
        """Detach (the mapping stays readable while views of it live)."""
        self._finalizer()


def _map(fd: int, nbytes: int) -> mmap.mmap:
    """The segment, mapped shared and writable (``cudaHostRegister`` needs write)."""
    return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def _serve(name: str, fd: int, message: bytes) -> Holding:
    """Bind this process's holder name of segment ``name`` and hand ``fd`` out from it."""
    while True:
        sock = rendezvous.bind(f"{name}.{os.getpid()}.{next(SERIALS)}")
        if sock is not None:  # a name of a forked-off parent's may be taken: the next serial
            return Holding(fd, rendezvous.Server(sock, message, fd))


SERIALS = itertools.count()


def _check_received(name: str, received: tuple[bytes, int], nbytes: int, digest: bytes) -> int:
    """The descriptor another process sent, after checking it holds these rows."""
    message, fd = received
    magic, size, held = MESSAGE.unpack(message)
    if magic == MAGIC and size == nbytes and held == digest and os.fstat(fd).st_size == nbytes:
        return fd
    os.close(fd)
    raise ValueError(f"the shared-memory segment {name} is in use but holds other contents "
                     f"({size:,} bytes, not these {nbytes:,}): a process of another version?")


def _check_peer(sock: socket.socket, name: str) -> int:
    """The pid at the other end of a connection to ``name``, a process of this user: rows sent
    by another user's process are never mapped."""
    pid, uid = rendezvous.peer(sock)
    if uid != os.getuid():
        raise PermissionError(errno.EACCES, f"the shared-memory segment name {name} is bound "
                              f"by process {pid} of another user (uid {uid})")
    return pid


def _from_holders(name: str, nbytes: int, digest: bytes) -> int | None:
    """The descriptor from the first listed holder that answers; None when none is listed
    (or all went away meanwhile). Live holders that never answer are an error naming them."""
    silent = []
    for holder, pid in holders(name):
        sock = rendezvous.connect(holder, HANDOVER_SECONDS)
        if sock is None:  # gone since the listing
            continue
        with sock:
            _check_peer(sock, holder)
            try:
                received = rendezvous.receive(sock, MESSAGE.size)
            except TimeoutError:
                silent.append(pid)
                continue
        if received is not None:
            return _check_received(name, received, nbytes, digest)
    if silent:
        raise TimeoutError(f"process(es) {', '.join(map(str, silent))} hold the shared-memory "
                           f"segment {name} but did not hand it over within {HANDOVER_SECONDS} "
                           "s (stopped?)")
    return None


def _from_creator(name: str, nbytes: int, digest: bytes, timeout: float | None,
                  deadline: float | None) -> int | None | bool:
    """The descriptor from the process creating the segment, once filled; False when nothing
    listens on its name, None when the creator went away (failed, died) or finished just now:
    the caller looks again."""
    remaining = None if deadline is None else max(deadline - time.monotonic(), 0.001)
    sock = rendezvous.connect(name, remaining)
    if sock is None:
        return False
    with sock:
        pid = _check_peer(sock, name)
        try:
            received = rendezvous.receive(sock, MESSAGE.size)
        except TimeoutError:
            raise TimeoutError(f"waited {timeout} s for process {pid} to fill the shared-memory "
                               f"segment {name} (timeout, or {TIMEOUT_ENV})") from None
    return None if received is None else _check_received(name, received, nbytes, digest)


def _create(name: str, creating: socket.socket, nbytes: int, digest: bytes,
            fill: Callable[[mmap.mmap], None],
            huge_pages: bool | None) -> tuple[mmap.mmap, Holding]:
    """Make, size, seal and fill the segment while holding its creation name, then serve it
    and hand it to those waiting. Raises ``SharedMemoryUnavailable`` before filling when it
    cannot be made or does not fit."""
    available = memory_available()
    if available is not None and nbytes > available:
        raise SharedMemoryUnavailable(errno.ENOSPC, f"the shared-memory segment needs "
                                      f"{nbytes:,} bytes but {available:,} bytes of memory are "
                                      "available")
    try:
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except (OSError, AttributeError) as error:
        raise SharedMemoryUnavailable(getattr(error, "errno", None) or errno.ENOSYS,
                                      f"no anonymous shared memory (memfd_create: {error})") \
            from None
    try:
        try:
            os.ftruncate(fd, nbytes)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            os.posix_fallocate(fd, 0, nbytes)  # reserve now: fail here, not mid-fill
        except OSError as error:
            if error.errno not in NO_ROOM:
                raise
            raise SharedMemoryUnavailable(error.errno, f"could not reserve {nbytes:,} bytes of "
                                          f"shared memory ({error.strerror}); "
                                          f"{available or 0:,} bytes seemed available") from None
        memory = _map(fd, nbytes)
        advise_huge_pages(memory, huge_pages)
        fill(memory)
        message = MESSAGE.pack(MAGIC, nbytes, digest)
        holding = _serve(name, fd, message)
    except BaseException:
        os.close(fd)
        raise
    rendezvous.hand_over(creating, message, fd)
    return memory, holding


def _private(name: str, nbytes: int, fill: Callable[[mmap.mmap], None],
             huge_pages: bool | None, reason: SharedMemoryUnavailable) -> mmap.mmap:
    """The rows in this process's own memory, with a warning naming why and the sizes."""
    warnings.warn(f"{reason.strerror}: the {nbytes:,} bytes of {name} go to this process's "
                  f"private memory instead (one copy per process; set {STRICT_ENV}=1 to refuse)",
                  SharedMemoryFallbackWarning, stacklevel=4)
    memory = anonymous_memory(nbytes, huge_pages)
    fill(memory)
    return memory


def _nothing() -> None:
    """Nothing to release: private rows go with their mapping."""


def _created(name: str, creating: socket.socket, nbytes: int, digest: bytes,
             fill: Callable[[mmap.mmap], None], huge_pages: bool | None, strict: bool,
             began: float) -> Segment | None:
    """The segment made here while ``creating`` holds its creation name (or, where shared
    memory cannot hold it and not ``strict``, the rows in private memory); None when a holder
    appeared meanwhile (a creator finished between the caller's two looks)."""
    with creating:
        if holders(name):
            return None
        try:
            memory, holding = _create(name, creating, nbytes, digest, fill, huge_pages)
        except SharedMemoryUnavailable as error:
            if strict:
                raise
            reason = error
        else:
            return Segment(name, memory, nbytes, True, time.perf_counter() - began, holding)
    memory = _private(name, nbytes, fill, huge_pages, reason)  # nobody waits on this fill
    return Segment(name, memory, nbytes, True, time.perf_counter() - began, None)


def _joined(name: str, fd: int, nbytes: int, digest: bytes, began: float) -> Segment:
    """The segment another process sent, mapped and served from here too."""
    try:
        memory = _map(fd, nbytes)
        holding = _serve(name, fd, MESSAGE.pack(MAGIC, nbytes, digest))
    except BaseException:
        os.close(fd)
        raise
    return Segment(name, memory, nbytes, False, time.perf_counter() - began, holding)


def attach(key: str, nbytes: int, fill: Callable[[mmap.mmap], None], *,
           directory: str | os.PathLike | None = None, huge_pages: bool | None = None,
           timeout: float | None = None, strict: bool | None = None) -> Segment:
    """The segment of ``key`` holding ``nbytes`` bytes of rows: attached when another process
    holds it or is filling it (waiting for the fill, at most ``timeout`` s, default
    ``$NGRAM_CUPY_SHM_TIMEOUT``; None: as long as the filling process lives), else created
    here, with ``fill(memory)`` writing the rows. Errors (``fill`` raising, a same-named segment
    of other contents) leave no segment. Where shared memory cannot hold it the rows go to
    private memory with a ``SharedMemoryFallbackWarning``, or with ``strict`` (default
    ``$NGRAM_CUPY_SHM_STRICT``) ``SharedMemoryUnavailable`` is raised."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
        raise ValueError(f"nbytes must be a positive integer, got {nbytes!r}")
    strict = strict_wanted(strict)
    timeout = wait_seconds(timeout)
    name = segment_name(key, directory)
    digest = key_digest(key)
    began = time.perf_counter()
    deadline = None if timeout is None else time.monotonic() + timeout
    silent_since = None
    while True:
        fd = _from_holders(name, nbytes, digest)
        if fd is None:
            creating = rendezvous.bind(name)
            if creating is not None:
                segment = _created(name, creating, nbytes, digest, fill, huge_pages, strict,
                                   began)
                if segment is not None:
                    return segment
                continue
            fd = _from_creator(name, nbytes, digest, timeout, deadline)
        if fd is None:
            silent_since = None
            continue
        if fd is not False:
            return _joined(name, fd, nbytes, digest, began)
        # bound, nobody listening: a creator between bind and listen, or one that has just
        # finished; a name bound by something else that never listens is an error
        silent_since = silent_since or time.monotonic()
        if time.monotonic() - silent_since > HANDOVER_SECONDS:
            raise TimeoutError(f"the shared-memory segment name {name} is bound but nothing "
                               f"answers on it for {HANDOVER_SECONDS} s")
        time.sleep(0.001)


def resident_bytes(path: str | os.PathLike, pid: int | str = "self") -> tuple[int, int]:
    """``(Rss, Pss)`` in bytes of a process's mappings of the file ``path`` (a segment's
    ``path``), from ``/proc/<pid>/smaps``: Rss counts each shared page fully in every process,
    Pss splits it among the processes that map it (their Pss sums to the memory it takes)."""
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
