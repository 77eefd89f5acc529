"""Processes of the shared-segment soak test (tests/memory/test_shared_memory.py): each attach
runs in a child forked from this long-lived process, so many rounds cost few interpreter starts.
It imports only ngram_cupy.memory.shared and segment_worker's fill pattern (no NumPy).

argv: mode, key, nbytes, seed.

- ``slot``: for each stdin line ``attach``, fork a child that attaches ``key`` (no timeout: the
  default, which waits as long as a creator lives; if it fills, it forks a process that lives
  until this one ends, as a worker pool forked meanwhile would) and prints one JSON line (``pid``,
  ``created``, ``seconds``, ``complete``), then holds it; a line ``end`` lets the child detach
  and exit, ``kill`` SIGKILLs it; either prints ``{"ended": pid}`` once it has ended.
- ``churn``: until stdin closes, fork children that attach ``key`` and SIGKILL each at a random
  moment (starting, waiting, filling, handing over, or holding), or let it detach; some fork
  while they fill, as slots do. Then print one JSON line: ``children``, ``killed`` and ``late``
  (pids of children that neither attached nor ended within ``LIMIT_S``).
"""

from __future__ import annotations

import json
import os
import random
import select
import signal
import sys
import time

from segment_worker import pattern  # this folder: the script's own, first on sys.path

from ngram_cupy.memory import shared as shared_memory

LIMIT_S = 10.0  # no attach may take longer
FILL_S = 0.02  # a window for waiters, and for kills mid-fill


def attach(key: str, nbytes: int, hold: int | None = None) -> shared_memory.Segment:
    """Attach (or create, filling slowly) the segment of ``key``, with no timeout; with
    ``hold``, a pipe's read end, a fill forks a process that lives until the pipe's writer
    closes it."""
    want = pattern(nbytes)

    def fill(memory) -> None:
        half = nbytes // 2
        memory[:half] = want[:half]
        if hold is not None and os.fork() == 0:
            os.read(hold, 1)
            os._exit(0)
        time.sleep(FILL_S)
        memory[half:] = want[half:]

    return shared_memory.attach(key, nbytes, fill)


def child(key: str, nbytes: int, release: int | None, hold: int | None = None) -> None:
    """Attach, report on stdout (slots only), hold until ``release`` reads end of file, exit."""
    try:
        segment = attach(key, nbytes, hold)
        if release is not None:
            print(json.dumps({"pid": os.getpid(), "created": segment.created,
                              "seconds": segment.seconds,
                              "complete": segment.memory[:] == pattern(nbytes)}), flush=True)
            os.read(release, 1)
        segment.close()
    except BaseException as error:  # noqa: BLE001 - reported, then this child ends
        print(json.dumps({"pid": os.getpid(), "error": repr(error)}), flush=True)
        os._exit(1)
    os._exit(0)


def fork_child(key: str, nbytes: int, pipe: tuple[int, int] | None,
               hold: tuple[int, int] | None = None) -> int:
    """A forked child running ``child``, holding the read ends of ``pipe`` (a slot's) and
    ``hold`` (for a fill to fork with)."""
    pid = os.fork()
    if pid == 0:
        for pair in (pipe, hold):
            if pair is not None:
                os.close(pair[1])
        child(key, nbytes, pipe[0] if pipe is not None else None,
              hold[0] if hold is not None else None)
    return pid


def slot(key: str, nbytes: int) -> None:
    """Run one child per ``attach`` line; ``end``/``kill`` finish the current one."""
    current = None
    hold = os.pipe()
    for line in sys.stdin:
        command = line.strip()
        if command == "attach":
            read, write = os.pipe()
            current = (fork_child(key, nbytes, (read, write), hold), write)
            os.close(read)
        elif command in ("end", "kill") and current is not None:
            pid, write = current
            if command == "kill":
                os.kill(pid, signal.SIGKILL)
            os.close(write)
            os.waitpid(pid, 0)
            print(json.dumps({"ended": pid}), flush=True)
            current = None
    os.close(hold[1])  # the processes forked in fills end


def churn(key: str, nbytes: int, rng: random.Random) -> None:
    """Children attaching the segment and dying at random moments, until stdin closes."""
    children = killed = 0
    late = []
    hold = os.pipe()
    while not select.select([sys.stdin], [], [], 0)[0]:
        pid = fork_child(key, nbytes, None, hold if rng.random() < 0.3 else None)
        children += 1
        if rng.random() < 0.7:
            time.sleep(rng.uniform(0, 2 * FILL_S))
            os.kill(pid, signal.SIGKILL)
            killed += 1
        began = time.monotonic()
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() - began > LIMIT_S:
                late.append(pid)
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                break
            time.sleep(0.002)
    sys.stdin.read()
    os.close(hold[1])  # the processes forked in fills end
    print(json.dumps({"children": children, "killed": killed, "late": late}), flush=True)


def main() -> None:
    mode, key, nbytes, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    if mode == "slot":
        slot(key, nbytes)
    else:
        churn(key, nbytes, random.Random(seed))


if __name__ == "__main__":
    main()
