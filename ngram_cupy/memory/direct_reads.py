"""Pages of files read around the page cache: ``O_DIRECT`` descriptors, Linux native AIO.

A disk table (``placement="disk"``) reads only the pages its rows touch, straight from the
device into page-aligned buffers, with many reads in flight: the kernel's asynchronous I/O
interface (``io_setup`` / ``io_submit`` / ``io_getevents``, the one ``fio --ioengine=libaio``
uses). The control blocks of a whole batch are built as one NumPy array and submitted by one
system call, so a lookup makes a handful of system calls from Python, never one per row, and
needs no thread: the device sees up to ``depth`` reads at once, refilled as soon as any
completes. Adjacent pages are read as one
run (at most ``MAX_RUN`` bytes).

Files on a filesystem that refuses ``O_DIRECT`` (the open, or the first read, fails with
``EINVAL``) are read through the page cache instead, and the pages read are dropped again
(``POSIX_FADV_DONTNEED``): the documented fallback. Every failure is an ``OSError`` naming the
file: a device error (the read's own errno), or a file shorter than when it was opened.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import platform

import numpy as np

from .page_reads import span_pages

PAGE = 4096  # the unit read: O_DIRECT needs offsets, lengths and buffers aligned to the block
MAX_RUN = 128 * 1024  # adjacent pages are read as one run of at most this many bytes
DEPTH = 256  # reads in flight: the block queue's depth here (nr_requests)
# io_setup, io_destroy, io_getevents, io_submit: the system call numbers of each architecture
SYSCALLS = {"x86_64": (206, 207, 208, 209), "aarch64": (0, 1, 4, 2)}
IOCB = np.dtype([("data", "<u8"), ("key", "<u4"), ("rw_flags", "<i4"), ("opcode", "<u2"),
                 ("reqprio", "<i2"), ("fd", "<u4"), ("buf", "<u8"), ("nbytes", "<u8"),
                 ("offset", "<i8"), ("reserved2", "<u8"), ("flags", "<u4"), ("resfd", "<u4")])
EVENT = np.dtype([("data", "<u8"), ("obj", "<u8"), ("res", "<i8"), ("res2", "<i8")])
_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.syscall.restype = ctypes.c_long


def aligned_buffer(nbytes: int) -> np.ndarray:
    """A page-aligned uint8 buffer of ``nbytes`` rounded up to pages (one at least), as
    O_DIRECT reads need, its pages faulted in now (``MAP_POPULATE``): a direct read into a page
    never touched faults it in inside ``io_submit``, which then takes twice as long."""
    nbytes = max(PAGE, -(-nbytes // PAGE) * PAGE)
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
                       | getattr(mmap, "MAP_POPULATE", 0))
    return np.frombuffer(memory, np.uint8)


def page_runs(first: np.ndarray, last: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(start page, page count)`` runs covering pages ``[first[i], last[i]]`` of every span,
    each page once, adjacent pages merged into runs of at most ``MAX_RUN`` bytes."""
    if first.size == 0:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    pages = span_pages(first, last)
    new = np.diff(pages, prepend=pages[0] - 2) != 1
    run = np.cumsum(new) - 1
    within = np.arange(pages.size) - np.flatnonzero(new)[run]
    new |= within % (MAX_RUN // PAGE) == 0  # split long runs
    starts = np.flatnonzero(new)
    return pages[starts], np.diff(starts, append=pages.size)


class DirectFile:
    """One file opened for reads around the page cache (``O_DIRECT``), or through it where the
    filesystem refuses that (``direct`` False: pages dropped after each read).

    ``path`` names the file in errors; ``source``: what to open (a path, or
    ``/proc/self/fd/N`` of a descriptor already open, so the same inode is read)."""

    def __init__(self, path: str, source: str | None = None):
        self.path = path
        source = path if source is None else source
        try:
            self.fd = os.open(source, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
            self.direct = hasattr(os, "O_DIRECT")
        except OSError as error:
            if error.errno != errno.EINVAL:
                raise OSError(error.errno, f"{path}: {error.strerror}") from None
            self.fd, self.direct = os.open(source, os.O_RDONLY), False
        self.size = os.fstat(self.fd).st_size

    def buffered(self) -> None:
        """Read through the page cache from now on (the filesystem refused a direct read)."""
        fd = os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY)
        os.close(self.fd)
        self.fd, self.direct = fd, False

    def dropped(self, offsets: np.ndarray, lengths: np.ndarray) -> None:
        """After a buffered read: drop those pages from the page cache again."""
        if not self.direct and hasattr(os, "posix_fadvise"):
            for offset, length in zip(offsets.tolist(), lengths.tolist(), strict=True):
                os.posix_fadvise(self.fd, offset, length, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        """Close the descriptor (once)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class AioContext:
    """A Linux AIO context with ``depth`` reads in flight: ``read`` fills page runs of files
    into one buffer, a batch at a time."""

    def __init__(self, depth: int = DEPTH):
        numbers = SYSCALLS.get(platform.machine())
        if numbers is None:
            raise OSError(errno.ENOSYS, f"placement='disk' reads with Linux AIO, which this "
                          f"platform ({platform.machine()}) does not offer here")
        self.setup, self.destroy, self.getevents, self.submit = numbers
        self.depth = int(depth)
        self.context = ctypes.c_ulong(0)
        if _LIBC.syscall(self.setup, self.depth, ctypes.byref(self.context)) < 0:
            code = ctypes.get_errno()
            raise OSError(code, f"io_setup: {os.strerror(code)} (placement='disk' reads with "
                          "Linux AIO)")
        self.events = np.zeros(self.depth, EVENT)
        self.submitted = 0  # reads submitted so far (tests, benchmarks)
        self.flight = 0  # reads of the current batch in flight
        self.batch = 0  # tags each read's ``data``: a completion of another batch is dropped

    def read(self, files: list[DirectFile], which: np.ndarray, offsets: np.ndarray,
             lengths: np.ndarray, buffer: np.ndarray, at: np.ndarray) -> None:
        """Read ``lengths[i]`` bytes at ``offsets[i]`` of ``files[which[i]]`` into
        ``buffer[at[i]:]`` (all page-aligned), ``depth`` at a time; an ``OSError`` naming the
        file for a failed or short read (a file shorter than when it was opened)."""
        self.batch = (self.batch + 1) & 0xFFFFFFFF
        blocks = np.zeros(which.size, IOCB)
        blocks["data"] = np.arange(which.size, dtype=np.uint64) | np.uint64(self.batch << 32)
        blocks["fd"] = [files[i].fd for i in which.tolist()] if which.size else []
        blocks["buf"] = buffer.ctypes.data + at
        blocks["nbytes"], blocks["offset"] = lengths, offsets
        pointers = (blocks.ctypes.data + np.arange(which.size, dtype=np.uint64)
                    * IOCB.itemsize).astype(np.uint64)
        self.flight = sent = 0  # reads of this batch submitted, and not yet completed
        refused = []  # requests a direct read of their file was refused for (EINVAL)
        try:
            while sent < which.size or self.flight:
                if sent < which.size and self.flight < self.depth:
                    count = min(self.depth - self.flight, which.size - sent)
                    try:
                        taken = self.call(self.submit, count, pointers[sent:].ctypes.data)
                    except OSError as error:  # the file of the first block not taken
                        file = files[int(which[sent])]
                        if error.errno != errno.EINVAL or not file.direct:
                            raise OSError(error.errno, f"{file.path}: {error.strerror}",
                                          file.path) from None
                        file.buffered()  # refused at submission: through the page cache
                        blocks["fd"][which == which[sent]] = file.fd
                        continue
                    sent, self.flight = sent + taken, self.flight + taken
                events = self.completed()
                index = (events["data"] & np.uint64(0xFFFFFFFF)).astype(np.int64)
                retry = (events["res"] == -errno.EINVAL) & np.array(
                    [file.direct for file in files], dtype=bool)[which[index]]
                refused.append(index[retry])
                index = index[~retry]
                self.check(files, which[index], offsets[index], lengths[index],
                           events["res"][~retry])
        finally:  # a failure leaves no read of this batch in flight for the next to take
            while self.flight:
                self.completed()
        self.submitted += which.size
        again = np.concatenate(refused) if refused else np.empty(0, np.int64)
        if again.size:  # the filesystem refuses O_DIRECT reads: through the page cache
            for i in np.unique(which[again]).tolist():
                files[i].buffered()
            self.read(files, which[again], offsets[again], lengths[again], buffer, at[again])
        for i in np.unique(which).tolist():
            if not files[i].direct:
                mine = which == i
                files[i].dropped(offsets[mine], lengths[mine])

    def completed(self) -> np.ndarray:
        """The completions of this batch's reads so far (waits for one at least); those of
        an earlier batch (none, unless a failure left them behind) are dropped."""
        events = self.events[:self.call(self.getevents, 1, self.depth,
                                        self.events.ctypes.data, None)]
        events = events[(events["data"] >> np.uint64(32)) == self.batch]
        self.flight -= events.size
        return events

    def call(self, number: int, *args) -> int:
        """One AIO system call on the context; an OSError for a failure (EINTR retried)."""
        while True:
            result = _LIBC.syscall(number, self.context, *(
                ctypes.c_long(a) if isinstance(a, int) else a for a in args))
            if result >= 0:
                return int(result)
            code = ctypes.get_errno()
            if code != errno.EINTR:
                raise OSError(code, os.strerror(code))

    @staticmethod
    def check(files: list[DirectFile], which, offsets, lengths, results) -> None:
        """An OSError naming the file for the first failed read, or a short one that stops
        before the file's size when opened (the file was truncated)."""
        for i in np.flatnonzero(results < lengths).tolist():
            file, result = files[int(which[i])], int(results[i])
            if result < 0:
                raise OSError(-result, f"{file.path}: reading {int(lengths[i])} bytes at "
                              f"{int(offsets[i])}: {os.strerror(-result)}", file.path)
            if int(offsets[i]) + result < min(file.size, int(offsets[i]) + int(lengths[i])):
                raise OSError(errno.EIO, f"{file.path} ends at {int(offsets[i]) + result} bytes "
                              f"but held {file.size} when the table was opened: the checkpoint "
                              "was truncated under the disk table; load it again", file.path)

    def close(self) -> None:
        """Destroy the context (waits for reads still in flight)."""
        if self.context.value:
            with contextlib.suppress(OSError):
                self.call(self.destroy)
            self.context = ctypes.c_ulong(0)
