"""The tests that send their process SIGINT or SIGTERM run here, in a process of their own
(``run_signal_worker`` in helpers.py starts it), so no signal can reach the pytest process and
land in another test (or a gc callback there). ``python signal_worker.py CASE ARGS...`` prints
the case's outcome as one JSON line."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import sys


def atomic_case(signum: str, folder: str) -> dict:
    """A signal that lands just after ``atomic_file``'s temporary appears (as a watcher sends
    it): what it raised, and what is left in ``folder``."""
    from ngram_cupy.runtime import atomic, interrupts

    real_open = os.open

    def open_then_signal(path, *args, **kwargs):
        fd = real_open(path, *args, **kwargs)
        if os.path.basename(path).startswith(atomic.TEMP_PREFIX):
            signal.raise_signal(int(signum))  # the handler raises here, as the file now exists
        return fd

    os.open = open_then_signal
    outcome = "nothing raised"
    try:
        with interrupts.honoured(), atomic.atomic_file(os.path.join(folder, "out.parquet")):
            outcome = "the block ran"
    except interrupts.Interrupted as error:
        outcome = f"{type(error).__name__}({error})"
    finally:
        os.open = real_open
    return {"outcome": outcome, "left": sorted(os.listdir(folder))}


def swallowed_case(cases: str) -> list[dict]:
    """``ngram-cupy ids`` runs (``cases``: JSON ``[{"argv": [...], "signum": n}]``) whose first
    batch gets a signal that is swallowed, as Numba's compiler callbacks swallow it: each run's
    status, output, swallowed signals, mapped batches and the files left beside its output."""
    from ngram_cupy.arrow import NGramIds
    from ngram_cupy.cli.main import main

    map_batch = NGramIds.__call__
    results = []
    for case in json.loads(cases):
        calls: list[int] = []
        swallowed: list[int] = []

        def interrupted_once(self, batch, calls=calls, swallowed=swallowed,
                             signum=case["signum"]):
            calls.append(batch.num_rows)
            if len(calls) == 1:
                try:
                    signal.raise_signal(signum)  # the handler runs here, inside the "compiler"
                except KeyboardInterrupt:
                    swallowed.append(signum)  # as ctypes does: printed, then dropped
            return map_batch(self, batch)

        NGramIds.__call__ = interrupted_once
        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            status = main(case["argv"])
        results.append({"status": status, "stdout": stdout.getvalue(),
                        "stderr": stderr.getvalue(), "swallowed": swallowed,
                        "calls": len(calls),
                        "left": sorted(os.listdir(os.path.dirname(case["argv"][2])))})
    NGramIds.__call__ = map_batch
    return results


if __name__ == "__main__":
    CASES = {"atomic": atomic_case, "swallowed": swallowed_case}
    print(json.dumps(CASES[sys.argv[1]](*sys.argv[2:])))
