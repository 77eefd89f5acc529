"""Hogwild on one shared table: two processes stepping on disjoint halves of the rows against
one process, in alternating repeats, with the machine's load beside each figure."""

from __future__ import annotations

import os

import numpy as np

from .report import Row, Section
from .sections_training import hogwild_seconds

REPEATS = 3  # alternating one- and two-process runs


def bench_hogwild(quick: bool) -> Section:
    """30 fused RowwiseAdagrad steps (quick: 10) of 4,096 tokens per process, 1 thread each, on
    a 262,144-row shared float32 table; steps per second of 2 processes against 1."""
    rows, steps = 1 << 18, 10 if quick else 30
    ones, twos, loads = [], [], []
    for _ in range(REPEATS):
        loads.append(os.getloadavg()[0])
        ones.append(steps / hogwild_seconds(1, rows, steps))
        twos.append(2 * steps / hogwild_seconds(2, rows, steps))
    loads.append(os.getloadavg()[0])
    ratios = np.array(twos) / np.array(ones)
    section = Section(f"Hogwild: {steps} steps of 4,096 tokens x 16 heads x 160 dims per "
                      f"process on one {rows:,}-row shared table, disjoint rows", "cpu")
    section.rows.append(Row(case="1 process", seconds=1 / float(np.median(ones)),
                            rate=f"{np.median(ones):.1f} steps/s"))
    section.rows.append(Row(case="2 processes", seconds=2 / float(np.median(twos)),
                            rate=f"{np.median(twos):.1f} steps/s",
                            notes=f"{np.median(ratios):.2f}x one process (median of {REPEATS} "
                                  f"alternating pairs: {', '.join(f'{r:.2f}' for r in ratios)};"
                                  f" target >= 1.6); 1-minute load average "
                                  f"{min(loads):.2f}-{max(loads):.2f} on "
                                  f"{os.cpu_count()} cores"))
    return section
