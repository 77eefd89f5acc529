"""Rows of a disk table kept in host memory within a byte budget, with exact counters.

Two tiers inside ``cache_bytes``: rows seeded from corpus statistics (``ngram-cupy stats``'
hottest rows, ``seed``), which stay, and recently read rows, evicted by a policy when the budget
is full: ``"lfu"`` (fewest uses, the least recent first among equals: the default, the best
of the three on the sample corpus, BENCHMARKS.md), ``"lru"`` (least recently used) or
``"clock"`` (one reference bit per row, a hand sweeping them). Each lookup hands over its
distinct rows at once: the tiers are searched with ``np.searchsorted`` in sorted row arrays and
the policy evicts a whole batch, so no Python runs per row.

``stats()`` counts, per tier and overall, the rows asked (``lookups``: distinct rows per table
lookup), ``hits`` and ``misses``, and the disk tier's reads, pages and bytes.

``cache_bytes`` counts the rows' records, the recent tier holding at most the table's rows that
are not seeded; the bookkeeping comes on top: 16 bytes per recent-tier slot from the start (its
row and its policy score) and 16 more per row cached there (the sorted keys and their slots), 8
per seeded row.
"""

from __future__ import annotations

import numbers

import numpy as np

POLICIES = ("lru", "clock", "lfu")
DEFAULT_POLICY = "lfu"
TIERS = ("seeded", "recent", "disk")


def check_policy(policy: str) -> str:
    """The policy name; a ValueError naming the choices otherwise."""
    if policy not in POLICIES:
        raise ValueError(f"cache_policy must be one of {', '.join(map(repr, POLICIES))}, got "
                         f"{policy!r}")
    return policy


class RowCache:
    """``cache_bytes`` of ``record_bytes``-byte rows (records) keyed by local row: the seeded
    tier first, the rest for recently read rows under ``policy``."""

    def __init__(self, record_bytes: int, cache_bytes: int = 0, policy: str = DEFAULT_POLICY,
                 max_rows: int | None = None):
        if isinstance(cache_bytes, bool) or not isinstance(cache_bytes, numbers.Integral) \
                or cache_bytes < 0:
            raise ValueError(f"cache_bytes must be a non-negative integer, got {cache_bytes!r}")
        self.policy = check_policy(policy)
        self.record_bytes, self.cache_bytes = int(record_bytes), int(cache_bytes)
        self.max_rows = max_rows  # the table's rows: never more slots than rows to cache
        self.seeded_rows = np.empty(0, np.int64)  # sorted
        self.seeded = np.empty((0, self.record_bytes), np.uint8)
        self.resize(cache_bytes // max(self.record_bytes, 1))
        self.counts = {tier: dict.fromkeys(("lookups", "hits", "misses"), 0) for tier in TIERS}
        self.counts["disk"].update(reads=0, pages=0, bytes=0)
        self.calls = 0

    def resize(self, capacity: int) -> None:
        """Empty the recent tier, with room for ``capacity`` rows (at most the table's rows
        that are not seeded)."""
        if self.max_rows is not None:
            capacity = min(int(capacity), self.max_rows - self.seeded_rows.size)
        self.capacity = max(int(capacity), 0)
        self.records = np.empty((self.capacity, self.record_bytes), np.uint8)
        self.keys = np.empty(0, np.int64)  # cached rows, sorted, ...
        self.key_slots = np.empty(0, np.int64)  # ... and their slots
        self.slot_rows = np.full(self.capacity, -1, np.int64)
        self.score = np.zeros(self.capacity, np.int64)  # lru: last use; lfu: uses; clock: bit
        self.hand = self.tick = 0

    def seed(self, rows: np.ndarray, records: np.ndarray) -> None:
        """Keep these local rows (sorted, unique) with their ``records`` for good; the recent
        tier gets what is left of the budget. A ValueError when they exceed ``cache_bytes``."""
        if rows.size * self.record_bytes > self.cache_bytes:
            raise ValueError(f"{rows.size} seeded rows of {self.record_bytes} bytes exceed "
                             f"cache_bytes={self.cache_bytes}")
        self.seeded_rows, self.seeded = rows.astype(np.int64), np.ascontiguousarray(records)
        self.resize((self.cache_bytes - rows.size * self.record_bytes) // self.record_bytes)

    def release(self) -> None:
        """Drop every cached row, seeded ones included (the table is closed); counters stay."""
        self.seeded_rows = np.empty(0, np.int64)
        self.seeded = np.empty((0, self.record_bytes), np.uint8)
        self.resize(0)

    def find(self, rows: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Copy the cached records of ``rows`` (local, sorted, unique) into ``out[i]``; the
        indexes of the rows missed (to read from disk), with every tier's counters updated."""
        self.calls += 1
        self.tick += 1
        missed = np.arange(rows.size)
        for tier, keys in (("seeded", self.seeded_rows), ("recent", self.keys)):
            at = np.minimum(np.searchsorted(keys, rows[missed]), max(keys.size - 1, 0))
            hit = keys[at] == rows[missed] if keys.size else np.zeros(missed.size, bool)
            counts = self.counts[tier]
            counts["lookups"] += missed.size
            counts["hits"] += int(hit.sum())
            counts["misses"] += int(missed.size - hit.sum())
            if tier == "seeded":
                out[missed[hit]] = self.seeded[at[hit]]
            else:
                slots = self.key_slots[at[hit]]
                out[missed[hit]] = self.records[slots]
                self.used(slots)
            missed = missed[~hit]
        self.counts["disk"]["lookups"] += missed.size
        return missed

    def used(self, slots: np.ndarray) -> None:
        """Note a use of these slots under the policy."""
        if self.policy == "lru":
            self.score[slots] = self.tick
        elif self.policy == "clock":
            self.score[slots] = 1
        else:  # uses in the high bits, the last use below them (ties: oldest first)
            self.score[slots] = (((self.score[slots] >> 32) + 1) << 32) | self.tick

    def read_from_disk(self, rows: int, reads: int, pages: int, nbytes: int) -> None:
        """Count what the disk tier read for ``rows`` rows."""
        disk = self.counts["disk"]
        disk["hits"] += rows
        disk["reads"] += reads
        disk["pages"] += pages
        disk["bytes"] += nbytes

    def insert(self, rows: np.ndarray, records: np.ndarray) -> None:
        """Keep these just-read rows (local, sorted, unique, none cached) in the recent tier,
        evicting under the policy; rows beyond its capacity are not kept."""
        rows, records = rows[:self.capacity], records[:self.capacity]
        if rows.size == 0:
            return
        free = np.flatnonzero(self.slot_rows < 0)[:rows.size]
        victims = self.victims(rows.size - free.size) if free.size < rows.size else free[:0]
        if victims.size:
            gone = np.searchsorted(self.keys, self.slot_rows[victims])
            self.keys, self.key_slots = np.delete(self.keys, gone), np.delete(self.key_slots,
                                                                              gone)
        slots = np.concatenate([free, victims])
        self.records[slots] = records
        self.slot_rows[slots] = rows
        self.score[slots] = 0
        self.used(slots)
        at = np.searchsorted(self.keys, rows)
        self.keys, self.key_slots = np.insert(self.keys, at, rows), np.insert(self.key_slots, at,
                                                                               slots)

    def victims(self, count: int) -> np.ndarray:
        """``count`` occupied slots to evict under the policy (free ones are being filled)."""
        occupied = self.slot_rows >= 0
        if self.policy != "clock":
            score = np.where(occupied, self.score, np.iinfo(np.int64).max)
            return np.argpartition(score, count - 1)[:count]
        order = (self.hand + np.arange(self.capacity)) % self.capacity
        order = order[occupied[order]]
        clear = order[self.score[order] == 0]
        if clear.size < count:  # a full sweep clears every bit: the next ones in order go
            self.score[:] = 0
            chosen = np.concatenate([clear, np.setdiff1d(order, clear, assume_unique=True)
                                     [:count - clear.size]])
            self.hand = int(chosen[-1] + 1) % self.capacity
            return chosen
        chosen = clear[:count]
        passed = order[:int(np.flatnonzero(order == chosen[-1])[0]) + 1]
        self.score[passed] = 0  # the hand clears the bits it passes
        self.hand = int(chosen[-1] + 1) % self.capacity
        return chosen

    def stats(self) -> dict:
        """Counters per tier and overall: ``lookups`` (table lookups for ``overall``, rows asked
        per tier), ``hits``, ``misses``, ``hit_rate`` and the disk tier's ``reads``, ``pages``
        and ``bytes``; ``cached_rows`` and ``capacity_rows`` of the cache."""
        tiers = {tier: dict(counts) for tier, counts in self.counts.items()}
        asked = tiers["seeded"]["lookups"]
        cached = tiers["seeded"]["hits"] + tiers["recent"]["hits"]
        for counts in tiers.values():
            counts["hit_rate"] = counts["hits"] / counts["lookups"] if counts["lookups"] else 0.0
        tiers["overall"] = {"lookups": self.calls, "rows": asked, "hits": cached,
                            "misses": asked - cached,
                            "hit_rate": cached / asked if asked else 0.0,
                            "bytes_read": tiers["disk"]["bytes"],
                            "cached_rows": int(self.seeded_rows.size + self.keys.size),
                            "capacity_rows": int(self.seeded_rows.size + self.capacity)}
        return tiers
