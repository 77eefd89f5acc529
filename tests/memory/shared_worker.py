"""One process of the shared-memory tests (started with multiprocessing spawn by
tests/memory/test_shared_memory.py): load a checkpoint with placement="shared", look ids up, report.

``job``: ``path`` (checkpoint), ``config`` (NGramConfig fields), ``ids`` (int64 [T, H]),
``out`` (where to save the lookup), ``mode``: ``"normal"``; ``"hang_in_fill"`` (stop for good
after the first shard of the fill, having set ``event``); ``"hang_after"`` (set ``event``
once loaded, then wait to be killed).
"""

from __future__ import annotations

import time

import numpy as np


def run(job: dict, barrier, event, results) -> None:
    """Load, look up, report ``(created, seconds, rss, pss)`` on ``results``; with a
    ``barrier``, measure while every process holds the table."""
    import ngram_cupy as nc
    from ngram_cupy.files import safetensors_files
    from ngram_cupy.memory.shared import resident_bytes

    if job["mode"] == "hang_in_fill":
        read = safetensors_files.Checkpoint.read

        def read_then_hang(self, *args, **kwargs):
            rows = read(self, *args, **kwargs)
            if len(args) > 1:  # a shard's rows, not a buffer: the fill has begun
                event.set()
                while True:
                    time.sleep(1)
            return rows

        safetensors_files.Checkpoint.read = read_then_hang
    embedding = nc.load_ngram_embedding(job["path"], nc.NGramConfig(**job["config"]), 0,
                                        placement="shared")
    table = embedding.table
    segment = table.storage.segment
    int(table.host_view.view(np.uint8).sum())  # every page mapped here, as a GPU registration does
    np.save(job["out"], table.lookup(np.asarray(job["ids"])).view(np.uint16))
    if job["mode"] == "hang_after":
        event.set()
        while True:
            time.sleep(1)
    if barrier is not None:
        barrier.wait()
    rss, pss = resident_bytes(segment.path)
    results.put((segment.created, segment.seconds, rss, pss))
    if barrier is not None:
        barrier.wait()  # nobody unmaps before everyone measured
    table.close()
