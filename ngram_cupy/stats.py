"""Statistics of a tokenized corpus that decide a layer's table size, placement and caching.

Collisions (``ngram_stats``): for every head, the distinct n-grams of its order (after the EOS cut,
exactly as hashed), the table rows they touch, the share of them that share a row with another,
the share uniform hashing would give, and the histogram of rows by load. Used to choose
``ngram_vocab_size_base``.

Row reuse (``reuse_stats``), on held-out documents: documents alternate between a profile part and
a measured part; the rows counted on the profile predict which rows are hot, and the measured
part says how many lookups those rows serve (``hit_rate_curve``: the input of a hot-row tier), how
many distinct rows batches of a given size hold (what de-duplicating a batch's gather saves), and
how steeply each order's row frequencies fall with rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from .arrow import DocumentPacker
from .hashing.histories import token_histories
from .hashing.layout import LayerLayout
from .ids.ngram_ids import compute_ngram_ids

# Pending n-grams (and row counts) are folded into the merged set once they outnumber it and this.
_MERGE_AT = 1 << 20
DEFAULT_HOT_ROWS = (1_000, 10_000, 100_000, 1_000_000)
DEFAULT_BATCH_TOKENS = (256, 4_096, 65_536)


@dataclass(frozen=True)
class HeadStats:
    """How one head's table rows are shared by the corpus's distinct n-grams."""

    head: int
    order: int  # n-gram length g: 2 .. ngram_size
    size: int  # rows of this head's table (a prime)
    distinct_ngrams: int
    rows_touched: int
    colliding_ngrams: int  # distinct n-grams that share their row with another
    load_histogram: np.ndarray  # [max_load + 1]: rows holding exactly k distinct n-grams

    @property
    def collision_share(self) -> float:
        """Share of distinct n-grams whose row also holds another n-gram."""
        return self.colliding_ngrams / self.distinct_ngrams if self.distinct_ngrams else 0.0

    @property
    def uniform_share(self) -> float:
        """The collision share that ideal uniform hashing gives: 1 - (1 - 1/size)^(N - 1)."""
        if self.distinct_ngrams < 2:
            return 0.0
        return float(-np.expm1((self.distinct_ngrams - 1) * np.log1p(-1.0 / self.size)))


class _DistinctNGrams:
    """The distinct n-grams of one order seen so far, each with its ids for that order's heads."""

    def __init__(self, order: int, heads: int) -> None:
        self.key_dtype = np.dtype((np.void, 8 * order))
        self.keys = np.zeros(0, dtype=self.key_dtype)
        self.ids = np.zeros((0, heads), dtype=np.int64)
        self._pending: list[tuple[np.ndarray, np.ndarray]] = []
        self._pending_size = 0

    def add(self, grams: np.ndarray, ids: np.ndarray) -> None:
        """Add ``grams[T, order]`` with their ``ids[T, heads]``; duplicates are dropped."""
        keys = np.ascontiguousarray(grams).view(self.key_dtype).ravel()
        keys, first = np.unique(keys, return_index=True)
        self._pending.append((keys, ids[first]))
        self._pending_size += keys.size
        if self._pending_size > max(self.keys.size, _MERGE_AT):  # amortised, bounded memory
            self.merge()

    def merge(self) -> None:
        """Fold the pending n-grams into the distinct set."""
        if not self._pending:
            return
        keys = np.concatenate([self.keys, *(k for k, _ in self._pending)])
        ids = np.concatenate([self.ids, *(i for _, i in self._pending)])
        self.keys, first = np.unique(keys, return_index=True)
        self.ids = ids[first]
        self._pending, self._pending_size = [], 0


def head_stats(layout: LayerLayout, head: int, ids: np.ndarray) -> HeadStats:
    """Statistics of one head from the ids of its order's distinct n-grams."""
    _, loads = np.unique(ids, return_counts=True)
    k = layout.heads_per_ngram
    return HeadStats(
        head=head,
        order=head // k + 2,
        size=int(layout.head_sizes[head]),
        distinct_ngrams=int(ids.size),
        rows_touched=int(loads.size),
        colliding_ngrams=int(loads[loads > 1].sum()),
        load_histogram=np.bincount(loads, minlength=1),  # [0] for a head with no n-grams
    )


def ngram_stats(batches: Iterable[pa.RecordBatch], layout: LayerLayout, column: str = "tokens",
                doc_id_column: str | None = None) -> tuple[list[HeadStats], int]:
    """Per-head statistics of every token of ``batches`` and the number of tokens seen.

    Rows are fresh sequences, or continue their document with ``doc_id_column`` (as for ids).
    """
    packer = DocumentPacker(layout, column, doc_id_column)
    k = layout.heads_per_ngram
    orders = {g: _DistinctNGrams(g, k) for g in range(2, layout.ngram_size + 1)}
    num_tokens = 0
    for batch in batches:
        packed = packer.pack(batch)
        batch_args = (packed.tokens, packed.query_start_loc, packed.ngram_context)
        histories = token_histories(layout, *batch_args)
        ids = compute_ngram_ids(layout, *batch_args)
        for g, seen in orders.items():
            seen.add(histories[:, :g], ids[:, (g - 2) * k : (g - 1) * k])
        num_tokens += packed.tokens.size
    stats = []
    for g, seen in orders.items():
        seen.merge()
        for j in range(k):
            stats.append(head_stats(layout, (g - 2) * k + j, seen.ids[:, j]))
    return stats, num_tokens


@dataclass(frozen=True)
class RowCounts:
    """How often each table row was looked up: ``rows`` sorted and unique, ``counts`` beside."""

    rows: np.ndarray  # int64
    counts: np.ndarray  # int64

    @property
    def lookups(self) -> int:
        """All lookups counted."""
        return int(self.counts.sum())

    def by_frequency(self) -> np.ndarray:
        """Row indices into ``rows``, most looked-up first (ties: lower row first)."""
        return np.lexsort((self.rows, -self.counts))


class RowCounter:
    """Counts row lookups over a stream of id arrays, in memory bounded by the distinct rows."""

    def __init__(self) -> None:
        self._merged = RowCounts(np.zeros(0, np.int64), np.zeros(0, np.int64))
        self._pending: list[RowCounts] = []
        self._pending_size = 0

    def add(self, ids: np.ndarray) -> None:
        """Count every id of ``ids`` (any shape) once per occurrence."""
        rows, counts = np.unique(ids, return_counts=True)
        self._pending.append(RowCounts(rows, counts))
        self._pending_size += rows.size
        if self._pending_size > max(self._merged.rows.size, _MERGE_AT):
            self.result()

    def result(self) -> RowCounts:
        """The counts so far."""
        if self._pending:
            self._merged = merge_counts(self._merged, *self._pending)
            self._pending, self._pending_size = [], 0
        return self._merged


def merge_counts(*parts: RowCounts) -> RowCounts:
    """The summed counts of several ``RowCounts``."""
    rows = np.concatenate([p.rows for p in parts])
    unique, inverse = np.unique(rows, return_inverse=True)
    counts = np.zeros(unique.size, dtype=np.int64)
    np.add.at(counts, inverse, np.concatenate([p.counts for p in parts]))
    return RowCounts(unique, counts)


def hottest_rows(counts: RowCounts, k: int) -> np.ndarray:
    """The ``k`` most looked-up rows (fewer if fewer were seen), sorted, unique, int64."""
    if k < 0:
        raise ValueError(f"k must be non-negative, got {k}")
    return np.sort(counts.rows[counts.by_frequency()[:k]]).astype(np.int64)


def hit_rate_curve(profile: RowCounts, measured: RowCounts, ks: Sequence[int]) -> np.ndarray:
    """For each K of ``ks``: the share of ``measured`` lookups that the K rows most looked up in
    ``profile`` serve. The input of hot-row planning: a tier of K rows serves this share."""
    ks = np.asarray(ks, dtype=np.int64)
    if ks.ndim != 1 or (ks < 0).any():
        raise ValueError(f"ks must be non-negative row counts, got {ks.tolist()}")
    if measured.lookups == 0:
        return np.zeros(ks.size)
    rank = np.empty(profile.rows.size, dtype=np.int64)
    rank[profile.by_frequency()] = np.arange(profile.rows.size)
    where = np.searchsorted(profile.rows, measured.rows)
    where = np.minimum(where, max(profile.rows.size - 1, 0))
    found = profile.rows.size > 0
    seen = (profile.rows[where] == measured.rows) if found else np.zeros(measured.rows.size, bool)
    ranks = rank[where[seen]]
    order = np.argsort(ranks, kind="stable")
    served = np.concatenate([[0], np.cumsum(measured.counts[seen][order])])
    return served[np.searchsorted(ranks[order], ks)] / measured.lookups


def rank_frequency_slope(counts: np.ndarray) -> float:
    """Least-squares slope of log(frequency) against log(rank) over the rows seen at least twice
    (about -1 for Zipf's law; NaN with fewer than two such rows)."""
    frequent = np.sort(counts[counts >= 2])[::-1].astype(np.float64)
    if frequent.size < 2:
        return float("nan")
    return float(np.polyfit(np.log(np.arange(1, frequent.size + 1)), np.log(frequent), 1)[0])


class DistinctInBatches:
    """The share of distinct rows among the lookups of consecutive ``batch_tokens``-token batches
    of a token stream (the last, partial batch included)."""

    def __init__(self, batch_tokens: int) -> None:
        if batch_tokens < 1:
            raise ValueError(f"batch_tokens must be positive, got {batch_tokens}")
        self.batch_tokens = batch_tokens
        self._carry: list[np.ndarray] = []
        self._carried = 0
        self.distinct = 0
        self.lookups = 0

    def _count(self, ids: np.ndarray) -> None:
        self.distinct += np.unique(ids).size
        self.lookups += ids.size

    def add(self, ids: np.ndarray) -> None:
        """The next ``[T, H]`` ids of the stream."""
        if self._carry:
            ids = np.concatenate([*self._carry, ids])
            self._carry, self._carried = [], 0
        full = ids.shape[0] - ids.shape[0] % self.batch_tokens
        for first in range(0, full, self.batch_tokens):
            self._count(ids[first : first + self.batch_tokens])
        if full < ids.shape[0]:
            self._carry, self._carried = [ids[full:].copy()], ids.shape[0] - full

    def share(self) -> float:
        """Distinct rows / lookups over every batch so far, the partial one included."""
        distinct, lookups = self.distinct, self.lookups
        if self._carry:
            distinct += np.unique(self._carry[0]).size
            lookups += self._carry[0].size
        return distinct / lookups if lookups else 0.0


@dataclass
class ReuseStats:
    """Row reuse of one layer, profiled on every other document and measured on the rest."""

    layout: LayerLayout
    profile_tokens: int
    measured_tokens: int
    profile: RowCounts
    measured: RowCounts
    hot_rows: np.ndarray  # the ladder of K
    hit_rates: np.ndarray  # share of measured lookups the profile's top K rows serve
    batch_tokens: tuple[int, ...]
    distinct_shares: tuple[float, ...]  # distinct rows / lookups within measured batches
    slopes: dict[int, float] = field(default_factory=dict)  # order -> rank-frequency slope

    def order_counts(self, order: int) -> np.ndarray:
        """The measured counts of the rows of one order's heads."""
        k = self.layout.heads_per_ngram
        offsets = self.layout.head_offsets
        first = int(offsets[(order - 2) * k])
        last = int(offsets[(order - 1) * k]) if (order - 1) * k < offsets.size \
            else self.layout.num_rows
        rows = self.measured.rows
        return self.measured.counts[(rows >= first) & (rows < last)]

    def all_counts(self) -> RowCounts:
        """Counts over every document, profiled and measured."""
        return merge_counts(self.profile, self.measured)


def reuse_stats(batches: Iterable[pa.RecordBatch], layout: LayerLayout, column: str = "tokens",
                doc_id_column: str | None = None, hot_rows: Sequence[int] = DEFAULT_HOT_ROWS,
                batch_tokens: Sequence[int] = DEFAULT_BATCH_TOKENS) -> ReuseStats:
    """Row reuse of ``layout``'s table on held-out documents.

    Documents (rows, or runs of rows of one document with ``doc_id_column``, also across
    batches) alternate: even ones are the profile, odd ones are measured.
    """
    packer = DocumentPacker(layout, column, doc_id_column)
    profile, measured = RowCounter(), RowCounter()
    windows = [DistinctInBatches(b) for b in batch_tokens]
    document = -1  # number of the last document seen
    last_doc = None
    tokens = [0, 0]
    for batch in batches:
        packed = packer.pack(batch)
        runs = packed.query_start_loc.size - 1
        numbers = document + 1 + np.arange(runs)
        if doc_id_column is not None and runs:
            doc = batch.column(doc_id_column)
            if document >= 0 and doc[0].as_py() == last_doc:
                numbers -= 1  # the first run continues the previous batch's last document
            last_doc = doc[-1].as_py()
        if runs:
            document = int(numbers[-1])
        held_out = np.repeat(numbers % 2 == 1, np.diff(packed.query_start_loc))
        ids = compute_ngram_ids(layout, packed.tokens, packed.query_start_loc,
                                packed.ngram_context)
        profile.add(ids[~held_out])
        kept = ids[held_out]
        measured.add(kept)
        for window in windows:
            window.add(kept)
        tokens[0] += int((~held_out).sum())
        tokens[1] += int(held_out.sum())
    profile_counts, measured_counts = profile.result(), measured.result()
    ladder = np.asarray(hot_rows, dtype=np.int64)
    stats = ReuseStats(
        layout=layout, profile_tokens=tokens[0], measured_tokens=tokens[1],
        profile=profile_counts, measured=measured_counts, hot_rows=ladder,
        hit_rates=hit_rate_curve(profile_counts, measured_counts, ladder),
        batch_tokens=tuple(int(b) for b in batch_tokens),
        distinct_shares=tuple(window.share() for window in windows),
    )
    stats.slopes = {g: rank_frequency_slope(stats.order_counts(g))
                    for g in range(2, layout.ngram_size + 1)}
    return stats


def plot_stats(stats: list[HeadStats], reuse: ReuseStats | None, path: str) -> None:
    """A PNG of rows by load (summed over each order's heads) and, with ``reuse``, the held-out
    hit-rate curve of the hottest rows and each order's rank-frequency curve (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    panels = 1 if reuse is None else 3
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4.5), squeeze=False)
    ax = axes[0, 0]
    for order in sorted({s.order for s in stats}):
        hists = [s.load_histogram for s in stats if s.order == order]
        total = np.zeros(max(h.size for h in hists), dtype=np.int64)
        for hist in hists:
            total[: hist.size] += hist
        loads = np.flatnonzero(total[1:]) + 1
        ax.plot(loads, total[loads], marker="o", label=f"{order}-grams ({len(hists)} heads)")
    ax.set_yscale("log")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("distinct n-grams in a row (row load)")
    ax.set_ylabel("table rows, summed over heads")
    ax.set_title("Row load of the n-gram tables")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper right")
    if reuse is not None:
        ax = axes[0, 1]
        top = max(reuse.profile.rows.size, 1)
        ks = np.unique(np.geomspace(1, top, 200).astype(np.int64))
        ax.plot(ks, 100 * hit_rate_curve(reuse.profile, reuse.measured, ks))
        ax.plot(reuse.hot_rows, 100 * reuse.hit_rates, "o")
        ax.set_xscale("log")
        ax.set_xlabel("hot rows K (the profile's most looked-up)")
        ax.set_ylabel("% of held-out lookups served")
        ax.set_title(f"Hot rows, layer {reuse.layout.layer}")
        ax.grid(True, which="both", alpha=0.3)
        ax = axes[0, 2]
        for order, slope in reuse.slopes.items():
            counts = np.sort(reuse.order_counts(order))[::-1]
            ranks = np.unique(np.geomspace(1, max(counts.size, 1), 400).astype(np.int64))
            ranks = ranks[ranks <= counts.size]
            ax.loglog(ranks, counts[ranks - 1], label=f"{order}-gram rows, slope {slope:.2f}")
        ax.set_xlabel("rank")
        ax.set_ylabel("held-out lookups of the row")
        ax.set_title("Rank-frequency of rows")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)
