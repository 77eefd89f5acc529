"""Mapped (placement="mmap") tables: the GPU-read capability decision and the page reads
(madvise(MADV_WILLNEED) of the rows a gather will read: before a lookup whose pages a mincore
sample finds out of memory, on a CPU prefetch's worker, on a thread of its own for GPU ids)."""

from __future__ import annotations

import ctypes
import dataclasses
import mmap
import os
import threading

import ml_dtypes
import numpy as np
import pytest
from conftest import layer_rows
from mapped_table import MappedTable

import ngram_cupy as nc
from ngram_cupy.codecs.dequant import reference_lookup
from ngram_cupy.memory import page_reads as page_prefetch
from ngram_cupy.runtime.backends import DEVICE, HOST
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


@pytest.fixture
def advice(monkeypatch):
    """Every ``madvise`` call, with its thread, recorded instead of made."""
    calls = []
    monkeypatch.setattr(page_prefetch, "madvise",
                        lambda address, length: calls.append((address, length,
                                                              threading.get_ident())))
    return calls


def residency(monkeypatch, answer):
    """``mincore`` answers ``answer(count)`` for a sample of ``count`` pages."""
    monkeypatch.setattr(page_prefetch, "resident_pages", lambda addresses: answer(len(addresses)))


def advised_pages(calls):
    """The pages the recorded calls advised."""
    return {p for address, length, _ in calls
            for p in range(address // mmap.PAGESIZE, (address + length) // mmap.PAGESIZE)}


def rows_pages(table, ids):
    """The pages of the rows of ``ids`` (global) in a mapped table."""
    pages = table.storage.pages
    return reference_pages(ids.reshape(-1) - table.row_start, pages.starts, pages.addresses,
                           pages.row_bytes, pages.num_rows, mmap.PAGESIZE)


def assert_rows(got, weight, ids):
    want = reference_lookup(weight, ids, np.float32(1), ml_dtypes.bfloat16)
    assert np.array_equal(got.view(np.uint16), want.view(np.uint16))


def test_a_lookup_reads_its_pages_itself_only_when_some_are_out_of_memory(
        table, bf16_layer, advice, monkeypatch):
    ids = np.random.default_rng(3).integers(0, 64, (256, 4))
    residency(monkeypatch, lambda count: [True] * count)
    assert_rows(table.lookup(ids), bf16_layer, ids)
    assert advice == [] and table.storage.pages.cold_reads == 0
    residency(monkeypatch, lambda count: [False] * count)
    assert_rows(table.lookup(ids), bf16_layer, ids)
    assert advised_pages(advice) == rows_pages(table, ids)
    assert {thread for *_, thread in advice} == {threading.get_ident()}  # before the gather
    assert table.storage.pages.cold_reads == 1
    residency(monkeypatch, lambda count: [True] * (count - 1) + [False])  # one page out
    advice.clear()
    assert_rows(table.lookup(ids), bf16_layer, ids)
    assert advised_pages(advice) == rows_pages(table, ids)
    assert table.storage.pages.cold_reads == 2


def test_without_mincore_a_lookup_faults_its_pages_in_as_before(table, bf16_layer, advice,
                                                                 monkeypatch):
    monkeypatch.setattr(page_prefetch, "MINCORE", None)
    assert page_prefetch.resident_pages([table.storage.pages.addresses[0]]) is None
    ids = np.arange(64).reshape(16, 4)
    assert_rows(table.lookup(ids), bf16_layer, ids)
    assert advice == [] and table.storage.pages.cold_reads == 0


def test_mincore_tells_touched_pages_from_untouched_ones():
    memory = mmap.mmap(-1, 2 * mmap.PAGESIZE)
    memory[0] = 1  # the first page only
    address = ctypes.addressof(ctypes.c_char.from_buffer(memory))
    assert page_prefetch.resident_pages([address, address + mmap.PAGESIZE]) == [True, False]
    assert page_prefetch.resident_pages([address + 1]) is None  # unaligned: the call fails


@pytest.mark.parametrize("count", [1, 255, 256, 4096, 100_000])
def test_the_residency_sample_grows_with_the_lookup_and_stays_small(table, count):
    local = np.random.default_rng(count).integers(0, 64, count)
    pages = table.storage.pages
    sample = pages.sample_pages(local)
    assert len(sample) == min(page_prefetch.MAX_SAMPLE,
                              1 + count // page_prefetch.ROWS_PER_SAMPLE)
    assert {address // mmap.PAGESIZE for address in sample} <= reference_pages(
        local, pages.starts, pages.addresses, pages.row_bytes, pages.num_rows, mmap.PAGESIZE)


def test_no_page_outside_the_owned_rows_is_read_and_bad_ids_read_nothing(
        table, bf16_layer, advice, monkeypatch):
    residency(monkeypatch, lambda count: [False] * count)
    with pytest.raises(IndexError, match=r"ids\[1, 2\] = 70"):
        table.lookup(np.array([[0, 21, 40, 63], [5, 5, 70, -1]]))
    assert advice == [] and table.storage.pages.cold_reads == 0
    storage = table.storage  # the same mapped rows as global rows [20, 84) of 100
    shard = MappedTable([(20 + int(start), rows.view(ml_dtypes.bfloat16))
                         for start, rows in zip(storage.starts, storage.blocks, strict=True)],
                        32, "bfloat16", None, 20, 84, 100)
    ids = np.random.default_rng(5).integers(0, 100, (128, 4))
    got = shard.lookup(ids)
    owned = (ids >= 20) & (ids < 84)
    want = reference_lookup(bf16_layer, np.where(owned, ids - 20, 0), np.float32(1),
                            ml_dtypes.bfloat16).reshape(128, 4, -1)
    want[~owned] = 0
    assert np.array_equal(got.view(np.uint16), want.reshape(128, -1).view(np.uint16))
    assert advised_pages(advice) == rows_pages(shard, ids[owned])
    shard.close()


def test_block_scales_pages_are_read_with_the_rows(advice, monkeypatch):
    rng = np.random.default_rng(9)
    codes = rng.integers(0, 256, (1000, 32), dtype=np.uint8)
    scales = np.full((1000, 4), 0x38, np.uint8)  # E4M3 1.0
    mapped_table = MappedTable([(0, codes, scales)], 64, "nvfp4", 1.0, 0, 1000, 1000)
    residency(monkeypatch, lambda count: [False] * count)
    ids = rng.integers(0, 1000, (64, 2))
    want = nc.EmbeddingTable(codes, dtype="nvfp4", block_scales=scales, scale=1.0).lookup(ids)
    assert np.array_equal(mapped_table.lookup(ids).view(np.uint16), want.view(np.uint16))
    page = mmap.PAGESIZE
    assert advised_pages(advice) == (
        reference_pages(ids.reshape(-1), [0], [codes.ctypes.data], 32, 1000, page)
        | reference_pages(ids.reshape(-1), [0], [scales.ctypes.data], 4, 1000, page))
    mapped_table.close()


def test_a_cpu_prefetch_reads_cold_pages_on_its_worker(table, bf16_layer, advice, monkeypatch):
    residency(monkeypatch, lambda count: [False] * count)
    ids = np.random.default_rng(4).integers(0, 64, (256, 4))
    table.prefetch(ids)
    assert_rows(table.lookup(ids), bf16_layer, ids)
    assert advised_pages(advice) == rows_pages(table, ids)
    assert threading.get_ident() not in {thread for *_, thread in advice}
    assert table.storage.pages.thread is None  # no advice thread for CPU ids
    advice.clear()
    table.prefetch(np.array([[0, 21, 40, 63], [5, 5, 70, -1]]))
    with pytest.raises(IndexError, match=r"ids\[1, 2\] = 70"):
        table.lookup(np.array([[0, 21, 40, 63], [5, 5, 70, -1]]))
    assert advice == []


def test_a_table_whose_pages_were_dropped_reads_them_once_with_the_same_rows(tmp_path):
    config = dataclasses.replace(CONFIG, ngram_vocab_size_base=2000)  # 512 KiB of rows
    weight = layer_rows(config, ml_dtypes.bfloat16)
    nc.save_ngram_embedding(tmp_path / "model", config, 0, weight, num_files=2)
    mapped_table = nc.load_ngram_embedding(tmp_path / "model", config, 0, placement="mmap").table
    ids = np.full((8, 4), len(weight) - 1)  # the last row: pages away from the files' headers
    for path in (tmp_path / "model").glob("*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    pages = mapped_table.storage.pages
    if page_prefetch.resident_pages(pages.sample_pages(ids.reshape(-1))) != [False]:
        pytest.skip("this file system keeps the file's pages (tmpfs) or mincore is missing")
    assert_rows(mapped_table.lookup(ids), weight, ids)
    assert pages.cold_reads == 1
    assert_rows(mapped_table.lookup(ids), weight, ids)  # now in memory: not read again
    assert pages.cold_reads == 1
    mapped_table.close()


def test_a_gpu_ids_prefetch_is_advised_off_the_callers_thread(table, advice):
    """The advice thread (fed by CuPy ids on the GPU; simulated here by submitting directly)."""
    ids = np.random.default_rng(6).integers(0, 64, (32, 4))
    table.storage.pages.submit(ids, 0)
    table.storage.pages.drain()
    assert advised_pages(advice) == rows_pages(table, ids)
    assert threading.get_ident() not in {thread for *_, thread in advice}
