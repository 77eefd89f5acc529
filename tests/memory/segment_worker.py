"""One process of the shared-segment kill tests (tests/memory/test_shared_memory.py): attach, check,
report, wait. It imports only ngram_cupy.memory.shared (no NumPy), so many start fast.

argv: key, nbytes, mode (``attach``; ``hang_in_fill``: report once half filled, then stop for
good), timeout s, fill delay s (a window for kills mid-fill). Prints one JSON line once
attached (``pid``, ``created``, ``seconds``, ``complete``: every byte as filled), then waits for
stdin to close (detaches, exits 0) or to be killed.
"""

from __future__ import annotations

import json
import os
import sys
import time

from ngram_cupy.memory import shared as shared_memory


def pattern(nbytes: int) -> bytes:
    """The bytes every fill writes: 0..250 repeated."""
    return (bytes(range(251)) * (nbytes // 251 + 1))[:nbytes]


def main() -> None:
    key, nbytes, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    timeout, delay = float(sys.argv[4]), float(sys.argv[5])
    want = pattern(nbytes)

    def fill(memory) -> None:
        half = nbytes // 2
        memory[:half] = want[:half]
        if mode == "hang_in_fill":
            print(json.dumps({"pid": os.getpid(), "filling": True}), flush=True)
            while True:
                time.sleep(1)
        time.sleep(delay)
        memory[half:] = want[half:]

    segment = shared_memory.attach(key, nbytes, fill, timeout=timeout)
    print(json.dumps({"pid": os.getpid(), "created": segment.created,
                      "seconds": segment.seconds, "complete": segment.memory[:] == want}),
          flush=True)
    sys.stdin.read()
    segment.close()


if __name__ == "__main__":
    main()
