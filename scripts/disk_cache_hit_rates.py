"""Hit rates of a disk table's row cache for the released layer's ids on the sample corpus.

    python scripts/disk_cache_hit_rates.py [--batch-tokens 4096] [--markdown]

Layer 0 of the released config (data/config.json: 320,001,536 rows) and data/'s corpus. As in
``ngram-cupy stats``, documents alternate: the even ones are the profile, whose hottest rows seed
the cache, the odd ones are measured, in order, ``--batch-tokens`` tokens per lookup (each
lookup's distinct rows, as a disk table asks its cache). Cache sizes are 1%, 5% and 10% of the
table's rows; policies LRU, CLOCK and LFU, and the statistics-seeded cache (half the budget
the profile's hottest rows, half LRU; and all of it seeded). Only ids are needed: the cache is
``RowCache`` with one byte per row, counting exactly what a disk table's would.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import pyarrow.parquet as pq

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import ngram_cupy as nc  # noqa: E402
from ngram_cupy.stats import hottest_rows, reuse_stats  # noqa: E402
from ngram_cupy.tables.row_cache import RowCache  # noqa: E402

SHARES = (0.01, 0.05, 0.10)


def measured_batches(layout, table, batch_tokens: int):
    """The odd documents' ids, in order, ``batch_tokens`` tokens a batch (``[T, 16]``)."""
    docs = table.column("doc_id").to_numpy()
    tokens = table.column("tokens").to_pylist()
    number = np.cumsum(np.diff(docs, prepend=docs[0] - 1) != 0) - 1  # documents in order
    pending = []
    for row in np.flatnonzero(number % 2 == 1):
        ids = nc.compute_ngram_ids(layout, np.asarray(tokens[row], np.int64),
                                   np.array([0, len(tokens[row])]),
                                   np.full((1, layout.config.ngram_size - 1),
                                           layout.config.eos_token_id))
        pending.append(ids)
        joined = np.concatenate(pending)
        while joined.shape[0] >= batch_tokens:
            yield joined[:batch_tokens]
            joined = joined[batch_tokens:]
        pending = [joined]
    if pending and pending[0].shape[0]:
        yield pending[0]


def hit_rate(batches, capacity: int, policy: str, seeded: np.ndarray | None) -> float:
    """The overall hit rate of a cache of ``capacity`` rows over the batches."""
    cache = RowCache(1, capacity, policy)
    if seeded is not None:
        cache.seed(seeded, np.zeros((seeded.size, 1), np.uint8))
    for ids in batches:
        rows = np.unique(ids)
        out = np.empty((rows.size, 1), np.uint8)
        missed = cache.find(rows, out)
        cache.insert(rows[missed], np.zeros((missed.size, 1), np.uint8))
    return cache.stats()["overall"]["hit_rate"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-tokens", type=int, default=4096)
    parser.add_argument("--markdown", action="store_true", help="a table for BENCHMARKS.md")
    parser.add_argument("--shares", type=float, nargs="+", default=SHARES,
                        help="cache sizes as shares of the table's rows (default 0.01 0.05 0.1)")
    args = parser.parse_args()
    config = nc.NGramConfig.from_hf(os.path.join(ROOT, "data", "config.json"))
    layout = nc.layer_layout(config, 0)
    corpus = pq.read_table(os.path.join(ROOT, "data", "python_stdlib.parquet"))
    started = time.perf_counter()
    profile = reuse_stats(corpus.to_batches(), layout, doc_id_column="doc_id").profile
    batches = list(measured_batches(layout, corpus, args.batch_tokens))
    lookups = sum(b.size for b in batches)
    distinct = np.unique(np.concatenate([np.unique(b) for b in batches])).size
    arms = [("LRU", "lru", 0.0), ("CLOCK", "clock", 0.0), ("LFU", "lfu", 0.0),
            ("seeded half + LRU", "lru", 0.5), ("seeded whole", "lru", 1.0)]
    rows = []
    for share in args.shares:
        capacity = int(layout.padded_rows * share)
        rates = []
        for _, policy, seed in arms:
            hot = hottest_rows(profile, int(capacity * seed)) if seed else None
            rates.append(hit_rate(batches, capacity, policy, hot))
        rows.append((share, capacity, rates))
        print(f"{share:.2%}: " + ", ".join(f"{name} {rate:.1%}" for (name, *_), rate
                                           in zip(arms, rates, strict=True)), flush=True)
    print(f"{lookups:,} lookups of {distinct:,} distinct rows in {len(batches)} batches of "
          f"{args.batch_tokens} tokens; profile {profile.rows.size:,} distinct rows; "
          f"{time.perf_counter() - started:.0f} s", flush=True)
    if args.markdown:
        print("\n| cache (share of 320,001,536 rows) | rows | "
              + " | ".join(name for name, *_ in arms) + " |")
        print("|---|---:|" + "---:|" * len(arms))
        for share, capacity, rates in rows:
            print(f"| {share:.2%} | {capacity:,} | "
                  + " | ".join(f"{rate:.1%}" for rate in rates) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
