"""Hash statistics against a brute-force count in plain Python, on tiny corpora."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ngram_cupy as nc

pa = pytest.importorskip("pyarrow")

from ngram_cupy.stats import HeadStats, ngram_stats  # noqa: E402

# Tiny tables (base 3) so that rows collide often.
CONFIG = nc.NGramConfig(vocab_size=12, ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=3,
                        eos_token_id=0)
LAYOUT = nc.layer_layout(CONFIG, 0)
MASK = (1 << 64) - 1


def brute_force(documents: list[list[int]]) -> list[dict]:
    """Per head: the rows each distinct EOS-cut n-gram hashes to, straight from SPEC section 2."""
    n, k, eos = CONFIG.ngram_size, CONFIG.heads_per_ngram, CONFIG.eos_token_id
    grams: dict[int, set[tuple[int, ...]]] = {g: set() for g in range(2, n + 1)}
    for document in documents:
        padded = [eos] * (n - 1) + document
        for t in range(n - 1, len(padded)):
            history, cut = [padded[t]], False
            for j in range(1, n):
                w = eos if cut else padded[t - j]
                cut = cut or w == eos
                history.append(w)
            for g in range(2, n + 1):
                grams[g].add(tuple(history[:g]))
    result = []
    for head in range(LAYOUT.num_heads):
        g = head // k + 2
        rows = Counter()
        for gram in grams[g]:
            mixed = 0
            for j, w in enumerate(gram):
                mixed ^= (w * int(LAYOUT.multipliers[j])) & MASK
            mixed -= (1 << 64) if mixed >> 63 else 0  # as signed int64
            rows[mixed % int(LAYOUT.head_sizes[head]) + int(LAYOUT.head_offsets[head])] += 1
        result.append(dict(
            distinct_ngrams=len(grams[g]),
            rows_touched=len(rows),
            colliding_ngrams=sum(load for load in rows.values() if load > 1),
            loads=Counter(rows.values()),
        ))
    return result


def corpus(rows: list[list[int]], doc_ids: list[int] | None = None) -> list:
    """The rows as record batches of two rows each."""
    columns = {"tokens": pa.array(rows, pa.list_(pa.int32()))}
    if doc_ids is not None:
        columns["doc"] = pa.array(doc_ids, pa.int64())
    table = pa.table(columns)
    return table.to_batches(max_chunksize=2)


def assert_matches(stats: list[HeadStats], expected: list[dict]) -> None:
    """Every figure of every head equals the brute-force count."""
    assert [s.head for s in stats] == list(range(LAYOUT.num_heads))
    for s, e in zip(stats, expected, strict=True):
        assert s.order == s.head // CONFIG.heads_per_ngram + 2
        assert s.size == LAYOUT.head_sizes[s.head]
        assert (s.distinct_ngrams, s.rows_touched, s.colliding_ngrams) == (
            e["distinct_ngrams"], e["rows_touched"], e["colliding_ngrams"])
        loads = {load: int(c) for load, c in enumerate(s.load_histogram) if load and c}
        assert loads == dict(e["loads"])


token = st.integers(0, CONFIG.vocab_size - 1)


@settings(max_examples=40, deadline=None)
@given(documents=st.lists(st.lists(token, max_size=15), min_size=1, max_size=6))
def test_stats_match_brute_force(documents):
    stats, num_tokens = ngram_stats(corpus(documents), LAYOUT)
    assert num_tokens == sum(len(d) for d in documents)
    assert_matches(stats, brute_force(documents))


def test_documents_split_into_rows_count_as_whole_documents():
    documents = [[1, 2, 3, 4, 5, 6, 1, 2, 3], [0, 7, 8, 0, 7, 8, 9], [5, 5, 5, 5]]
    rows, doc_ids = [], []
    for doc_id, document in enumerate(documents):
        for first in range(0, len(document), 2):
            rows.append(document[first : first + 2])
            doc_ids.append(doc_id)
    whole = brute_force(documents)
    stats, _ = ngram_stats(corpus(rows, doc_ids), LAYOUT, doc_id_column="doc")
    assert_matches(stats, whole)
    fresh_rows, _ = ngram_stats(corpus(rows), LAYOUT)  # each row alone: other n-grams
    assert [s.distinct_ngrams for s in fresh_rows] != [e["distinct_ngrams"] for e in whole]


def test_an_empty_corpus_has_no_loads():
    from ngram_cupy.cli.stats import describe_stats

    stats, num_tokens = ngram_stats(corpus([[], []]), LAYOUT)
    assert num_tokens == 0 and all(s.load_histogram.tolist() == [0] for s in stats)
    table = describe_stats(stats, num_tokens, LAYOUT)[2:2 + LAYOUT.num_heads]
    assert all(line.split()[-1] == "0" for line in table), table  # max load 0, not -1


def test_merging_pending_ngrams_keeps_them_distinct(monkeypatch):
    import ngram_cupy.stats as stats_module

    documents = [[i % 11 + 1, (i * 7) % 11 + 1, 3] for i in range(40)]
    monkeypatch.setattr(stats_module, "_MERGE_AT", 1)  # merge after every batch
    stats, _ = ngram_stats(corpus(documents), LAYOUT)
    assert_matches(stats, brute_force(documents))


def test_uniform_share():
    def head(n: int, size: int) -> HeadStats:
        return HeadStats(head=0, order=2, size=size, distinct_ngrams=n, rows_touched=n,
                         colliding_ngrams=0, load_histogram=np.zeros(2, dtype=np.int64))

    assert head(0, 10).uniform_share == 0.0 and head(1, 10).uniform_share == 0.0
    assert head(2, 10).uniform_share == pytest.approx(0.1)
    assert head(11, 10).uniform_share == pytest.approx(1 - 0.9**10)
    assert head(0, 10).collision_share == 0.0


# --- held-out row reuse ---------------------------------------------------------------------

from ngram_cupy.stats import (  # noqa: E402
    DistinctInBatches,
    RowCounts,
    hit_rate_curve,
    hottest_rows,
    merge_counts,
    rank_frequency_slope,
    reuse_stats,
)


def counts_of(ids) -> RowCounts:
    rows, counts = np.unique(np.asarray(ids, dtype=np.int64), return_counts=True)
    return RowCounts(rows, counts)


def brute_top(profile: dict[int, int], k: int) -> set[int]:
    """The k rows with the highest counts, ties to the lower row."""
    return {row for row, _ in sorted(profile.items(), key=lambda rc: (-rc[1], rc[0]))[:k]}


rows_lists = st.lists(st.integers(0, 30), max_size=60)


@settings(max_examples=60, deadline=None)
@given(profile=rows_lists, measured=rows_lists, ks=st.lists(st.integers(0, 40), max_size=5))
def test_hit_rate_curve_matches_brute_force(profile, measured, ks):
    shares = hit_rate_curve(counts_of(profile), counts_of(measured), ks)
    p = Counter(profile)
    for k, share in zip(ks, shares, strict=True):
        top = brute_top(p, k)
        expected = sum(row in top for row in measured) / len(measured) if measured else 0.0
        assert share == pytest.approx(expected)
        assert hottest_rows(counts_of(profile), k).tolist() == sorted(top)


def test_hottest_rows_are_sorted_unique_int64():
    counts = RowCounts(np.array([3, 5, 9, 12]), np.array([7, 1, 7, 9]))
    rows = hottest_rows(counts, 3)
    assert rows.dtype == np.int64 and rows.tolist() == [3, 9, 12]
    assert hottest_rows(counts, 10).tolist() == [3, 5, 9, 12]
    merged = merge_counts(counts, RowCounts(np.array([5, 40]), np.array([10, 1])))
    assert merged.rows.tolist() == [3, 5, 9, 12, 40] and merged.counts.tolist() == [7, 11, 7, 9, 1]


@settings(max_examples=40, deadline=None)
@given(tokens=st.integers(0, 50), size=st.integers(1, 9), cuts=st.lists(st.integers(0, 50)),
       seed=st.integers(0, 100))
def test_distinct_in_batches_matches_windows(tokens, size, cuts, seed):
    ids = np.random.default_rng(seed).integers(0, 12, (tokens, 3))
    windows = DistinctInBatches(size)
    for piece in np.split(ids, sorted(c for c in cuts if c <= tokens)):
        windows.add(piece)
    chunks = [ids[i : i + size] for i in range(0, tokens, size)]
    distinct = sum(np.unique(c).size for c in chunks)
    assert windows.share() == pytest.approx(distinct / ids.size if ids.size else 0.0)


def test_rank_frequency_slope_of_a_power_law():
    counts = np.round(1e6 / np.arange(1, 2000) ** 1.5).astype(np.int64)
    assert rank_frequency_slope(counts) == pytest.approx(-1.5, abs=0.02)
    assert np.isnan(rank_frequency_slope(np.array([5, 1, 1])))


def whole_ids(documents: list[list[int]]) -> np.ndarray:
    """``[T, H]`` ids of documents computed whole, each a fresh sequence."""
    flat = np.array([t for d in documents for t in d], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum([len(d) for d in documents])])
    context = np.full((len(documents), CONFIG.ngram_size - 1), CONFIG.eos_token_id)
    return nc.compute_ngram_ids(LAYOUT, flat, starts, context).reshape(-1, LAYOUT.num_heads)


@settings(max_examples=30, deadline=None)
@given(documents=st.lists(st.lists(token, min_size=1, max_size=7), min_size=1, max_size=7))
def test_reuse_profiles_even_documents_and_measures_odd_ones(documents):
    rows, doc_ids = [], []
    for doc_id, document in enumerate(documents):  # each document split into rows of 3
        for first in range(0, len(document), 3):
            rows.append(document[first : first + 3])
            doc_ids.append(doc_id * 10)
    reuse = reuse_stats(corpus(rows, doc_ids), LAYOUT, doc_id_column="doc", hot_rows=[0, 2, 50],
                        batch_tokens=[4])
    profile = whole_ids(documents[0::2])
    measured = whole_ids(documents[1::2]) if len(documents) > 1 else np.zeros((0, 4), np.int64)
    assert reuse.profile_tokens == profile.shape[0]
    assert reuse.measured_tokens == measured.shape[0]
    for got, ids in ((reuse.profile, profile), (reuse.measured, measured)):
        want = counts_of(ids.ravel())
        assert got.rows.tolist() == want.rows.tolist()
        assert got.counts.tolist() == want.counts.tolist()
    np.testing.assert_allclose(reuse.hit_rates,
                               hit_rate_curve(counts_of(profile.ravel()),
                                              counts_of(measured.ravel()), [0, 2, 50]))
    windows = DistinctInBatches(4)
    windows.add(measured)
    assert reuse.distinct_shares == (windows.share(),)
