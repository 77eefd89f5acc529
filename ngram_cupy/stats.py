"""Hash statistics of a tokenized corpus: how the distinct n-grams of each head share table rows.

For every head: the distinct n-grams of its order (after the EOS cut, exactly as hashed), the
table rows they touch, the share of them that share a row with another, the share uniform
hashing would give, and the histogram of rows by load. Used to choose ``ngram_vocab_size_base``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from .arrow import DocumentPacker
from .histories import token_histories
from .layout import LayerLayout
from .ngram_ids import compute_ngram_ids

# Pending n-grams are folded into the distinct set once they outnumber it and this count.
_MERGE_AT = 1 << 20


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


def plot_load_histograms(stats: list[HeadStats], path: str) -> None:
    """A PNG of rows by load, summed over the heads of each order (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(7, 4.5))
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
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)
