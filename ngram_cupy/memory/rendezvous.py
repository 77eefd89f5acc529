"""Rendezvous of shared segments: abstract-namespace Unix sockets that hand a descriptor on.

A name in the abstract namespace (Linux) is no file: the kernel drops it with the last socket
bound to it, so a killed process leaves none behind. A process that holds a segment binds a
name, listens, and a thread of it sends the segment's descriptor (``SCM_RIGHTS``) with a short
message to every connecting process of the same user. Bound names are listed from
``/proc/net/unix`` (the sockets of this network namespace, as the abstract names are).
"""

from __future__ import annotations

import array
import errno
import os
import socket
import struct
import threading
import time

BACKLOG = 4096  # waiters queue here while a segment is filled (the kernel caps it: somaxconn)
PEER_CREDENTIALS = struct.Struct("3i")  # pid, uid, gid (SO_PEERCRED)
UNIX_TABLE = "/proc/net/unix"


def bind(name: str) -> socket.socket | None:
    """A listening socket bound to the abstract ``name``; None when another socket has it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind("\0" + name)
    except OSError as error:
        sock.close()
        if error.errno == errno.EADDRINUSE:
            return None
        raise
    sock.listen(BACKLOG)
    return sock


def connect(name: str, timeout: float | None) -> socket.socket | None:
    """A socket connected to the abstract ``name``; None when nothing listens there."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect("\0" + name)
    except (ConnectionRefusedError, FileNotFoundError):
        sock.close()
        return None
    except BaseException:
        sock.close()
        raise
    return sock


def peer(sock: socket.socket) -> tuple[int, int]:
    """``(pid, uid)`` of the process at the other end of a connected socket."""
    data = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEER_CREDENTIALS.size)
    pid, uid, _ = PEER_CREDENTIALS.unpack(data)
    return pid, uid


def bound_names(prefix: str) -> list[str]:
    """The abstract names starting with ``prefix`` that sockets of this namespace hold."""
    wanted = "@" + prefix
    names = set()
    with open(UNIX_TABLE) as table:
        next(table, None)  # the header line
        for line in table:
            fields = line.split()
            if len(fields) > 7 and fields[7].startswith(wanted):
                names.add(fields[7][1:])
    return sorted(names)


def send(conn: socket.socket, message: bytes, fd: int) -> None:
    """Send ``message`` with the descriptor ``fd`` (the peer gets its own duplicate)."""
    socket.send_fds(conn, [message], [fd])


def receive(sock: socket.socket, size: int) -> tuple[bytes, int] | None:
    """A message of ``size`` bytes and the descriptor sent with it (close-on-exec: no program
    this process starts keeps it); None when the sender closed the connection (or died) first.
    Raises ``TimeoutError`` past the socket's timeout."""
    descriptors = array.array("i")
    try:  # recvmsg itself: socket.recv_fds drops its flags (CPython 3.11)
        message, ancillary, _, _ = sock.recvmsg(size, socket.CMSG_LEN(descriptors.itemsize),
                                                socket.MSG_CMSG_CLOEXEC)
    except (ConnectionResetError, BrokenPipeError):
        return None
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            descriptors.frombytes(data[: len(data) - len(data) % descriptors.itemsize])
    if not descriptors:
        return None
    for extra in descriptors[1:]:
        os.close(extra)
    if len(message) != size:
        os.close(descriptors[0])
        return None
    return message, descriptors[0]


def hand_over(sock: socket.socket, message: bytes, fd: int) -> None:
    """Send the descriptor to every connection already waiting on a listening socket, without
    blocking (later ones find the segment elsewhere)."""
    sock.setblocking(False)
    while True:
        try:
            conn, _ = sock.accept()
        except OSError:  # none left (or one gone meanwhile): later ones look elsewhere
            return
        with conn:
            conn.setblocking(True)
            give(conn, message, fd)


def give(conn: socket.socket, message: bytes, fd: int) -> None:
    """Send the descriptor when the peer is a process of this user; drop it otherwise."""
    try:
        if peer(conn)[1] == os.getuid():
            send(conn, message, fd)
    except OSError:  # the peer went away meanwhile: nothing to hand over
        pass


class Server:
    """A thread handing ``fd`` with ``message`` to every process of this user that connects to
    the bound, listening ``sock``; ``close()`` stops it."""

    def __init__(self, sock: socket.socket, message: bytes, fd: int):
        self.sock, self.message, self.fd = sock, message, fd
        self.closing = False
        self.thread = threading.Thread(target=self._serve, name="ngram_cupy-segment-server",
                                       daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                if self.closing:  # shut down
                    return
                time.sleep(0.01)  # out of descriptors, say: answer again once there are some
                continue
            with conn:
                give(conn, self.message, self.fd)

    def close(self) -> None:
        """Stop answering (the name is gone once every copy of the socket is closed)."""
        self.closing = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the thread's accept
        except OSError:
            pass
        self.thread.join(5.0)
        self.sock.close()
