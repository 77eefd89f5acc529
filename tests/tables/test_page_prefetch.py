"""Mapped (placement="mmap") tables: the GPU-read capability decision and the page prefetcher
(madvise(MADV_WILLNEED) of the rows a prefetch will read, off the caller's thread)."""

from __future__ import annotations

import mmap
import threading

import ml_dtypes
import numpy as np
import pytest
from conftest import layer_rows

import ngram_cupy as nc
from ngram_cupy.runtime.backends import DEVICE, HOST
from ngram_cupy.tables import page_prefetch
from ngram_cupy.tables.dequant import reference_lookup
from ngram_cupy.tables.storage import mapped

# 4 heads of prime sizes 11, 13, 17, 19: 60 rows padded to 64, in 3 shards; rows of 256 bytes.
CONFIG = nc.NGramConfig(
    vocab_size=50, ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=11, eos_token_id=0,
    embedding_dim=128, make_ngram_vocab_size_divisible_by=8, split_ngram_parts=3,
)


@pytest.fixture
def bf16_layer():
    """The padded bf16 table of layer 0."""
    return layer_rows(CONFIG, ml_dtypes.bfloat16)


@pytest.fixture
def table(tmp_path, bf16_layer):
    nc.save_ngram_embedding(tmp_path / "model", CONFIG, 0, bf16_layer, num_files=2)
    table = nc.load_ngram_embedding(tmp_path / "model", CONFIG, 0, placement="mmap").table
    yield table
    table.close()


def test_the_gpu_reads_mapped_pages_only_where_the_device_says_so():
    asked = []

    def attribute(value):
        return lambda attr, device: asked.append((attr, device)) or value

    assert mapped.gpu_reads_pageable(attribute(1), device=3) is True
    assert mapped.gpu_reads_pageable(attribute(0), device=0) is False
    assert asked == [(mapped.PAGEABLE_MEMORY_ACCESS, 3), (mapped.PAGEABLE_MEMORY_ACCESS, 0)]
    assert mapped.PAGEABLE_MEMORY_ACCESS == 88  # cudaDevAttrPageableMemoryAccess in CUDA 12/13


def test_a_device_without_pageable_access_is_refused_by_name(table):
    table.storage.pageable = False
    with pytest.raises(ValueError, match="cudaDevAttrPageableMemoryAccess"):
        table.destination(DEVICE, (2, 4), None, None)
    table.storage.pageable = True  # as on an HMM / ATS device
    assert table.storage.reads(DEVICE) and table.storage.reads(HOST)
    assert table.destination(DEVICE, (2, 4), None, None)[1] is None


def reference_pages(ids, starts, addresses, row_bytes, num_rows, page):
    """Every page touched by a row of ``ids``, row by row."""
    pages = set()
    for row in ids:
        if 0 <= row < num_rows:
            block = max(i for i, start in enumerate(starts) if start <= row)
            begin = addresses[block] + (row - starts[block]) * row_bytes
            pages.update(range(begin // page, (begin + row_bytes - 1) // page + 1))
    return pages


@pytest.mark.parametrize("row_bytes", [256, 4096, 5000])
def test_page_runs_cover_exactly_the_pages_of_the_rows(row_bytes):
    rng = np.random.default_rng(row_bytes)
    starts = np.array([0, 40, 100])
    addresses = np.array([7 * 4096 + 123, 1 << 30, (1 << 31) + 4000])
    ids = rng.integers(-5, 130, 60)
    runs = page_prefetch.page_runs(ids, starts, addresses, row_bytes, 120, 4096)
    covered = [p for address, length in runs
               for p in range(address // 4096, (address + length) // 4096)]
    assert all(address % 4096 == 0 and length % 4096 == 0 for address, length in runs)
    assert len(covered) == len(set(covered))
    assert set(covered) == reference_pages(ids, starts, addresses, row_bytes, 120, 4096)
    ends = [address + length for address, length in runs]
    assert all(end < start for end, (start, _) in zip(ends, runs[1:], strict=False))  # merged


def test_a_prefetch_advises_its_rows_off_the_callers_thread(table, bf16_layer, monkeypatch):
    calls = []
    monkeypatch.setattr(page_prefetch, "madvise",
                        lambda address, length: calls.append((address, length,
                                                              threading.get_ident())))
    ids = np.array([[0, 21, 40, 63], [5, 5, 70, -1]])
    table.prefetch(ids)  # ids outside the table: advised nothing, refused by the lookup
    with pytest.raises(IndexError, match=r"ids\[1, 2\] = 70"):
        table.lookup(ids)
    table.storage.pages.drain()
    assert calls and all(thread != threading.get_ident() for *_, thread in calls)
    storage = table.storage
    pages = reference_pages(ids.reshape(-1), storage.starts, storage.pages.addresses,
                            storage.pages.row_bytes, storage.num_rows, mmap.PAGESIZE)
    advised = {p for address, length, _ in calls
               for p in range(address // mmap.PAGESIZE, (address + length) // mmap.PAGESIZE)}
    assert advised == pages


def test_real_advice_changes_no_result(table, bf16_layer):
    ids = np.random.default_rng(3).integers(0, 64, (256, 4))
    table.prefetch(ids)
    got = table.lookup(ids)
    table.storage.pages.drain()
    assert table.storage.pages.advised > 0
    want = reference_lookup(bf16_layer, ids, np.float32(1), ml_dtypes.bfloat16)
    assert np.array_equal(got.view(np.uint16), want.view(np.uint16))
