"""The prefetch protocol on the CPU worker (always) and on a CUDA side stream (with a GPU);
pinned host tables."""

from __future__ import annotations

import gc
import multiprocessing
import os
import threading

import ml_dtypes
import numpy as np
import pytest
from conftest import HAS_GPU

import ngram_cupy as nc
from ngram_cupy.codecs.dequant import reference_lookup
from ngram_cupy.memory.pinned import PinnedBuffer, release_deferred
from ngram_cupy.tables import gather_numba
from ngram_cupy.tables.prefetch import Pending

SCALE = 0.75


@pytest.fixture
def fp8_small():
    rng = np.random.default_rng(0)
    return (rng.standard_normal((200, 8)) * 4).astype(ml_dtypes.float8_e4m3fn)


def expected(fp8_small, ids, out_dtype=ml_dtypes.bfloat16):
    return reference_lookup(fp8_small, ids, SCALE, out_dtype)


TOTAL = 210  # the tables' 200 rows are a shard of 210: ids past them give zero rows


def random_ids(seed, shape=(33, 4), high=TOTAL):
    return np.random.default_rng(seed).integers(0, high, shape)


def test_prefetch_then_lookup(fp8_small):
    table = nc.EmbeddingTable(fp8_small, scale=SCALE, total_rows=TOTAL)
    ids = random_ids(1)
    table.prefetch(ids)
    np.testing.assert_array_equal(table.lookup(ids), expected(fp8_small, ids))


def test_the_prefetch_gathers_a_copy_of_the_ids(fp8_small):
    table = nc.EmbeddingTable(fp8_small, scale=SCALE, total_rows=TOTAL)
    ids = random_ids(2)
    original = ids.copy()
    table.prefetch(ids)
    ids[:] = 7  # the caller reuses its buffer at once
    np.testing.assert_array_equal(table.lookup(original), expected(fp8_small, original))
    table.prefetch(original)
    table.prefetcher.threads.wait()  # gathered (not yet joined) before the caller moves on
    original[::2] = 7  # the same buffer, refilled: the rows that changed must be gathered again
    np.testing.assert_array_equal(table.lookup(original), expected(fp8_small, original))


def test_stale_prefetch_is_joined_then_the_changed_heads_regathered(fp8_small, monkeypatch):
    table = nc.EmbeddingTable(fp8_small, scale=SCALE, total_rows=TOTAL)
    prefetched = random_ids(3)
    asked = prefetched.copy()
    asked[::3, 1] = random_ids(4, asked[::3, 1].shape)
    finished = []
    release = threading.Event()
    real = gather_numba.gather_rows

    def slow_gather(*args, **kwargs):  # the worker's gather, held until released
        if threading.current_thread() is not threading.main_thread():
            release.wait(5)
            finished.append(True)
        return real(*args, **kwargs)

    monkeypatch.setattr(gather_numba, "gather_rows", slow_gather)
    table.prefetch(prefetched)
    threading.Timer(0.05, release.set).start()
    result = table.lookup(asked)
    assert finished == [True]  # joined: the stale gather finished before lookup returned
    np.testing.assert_array_equal(result, expected(fp8_small, asked))


def test_a_stale_prefetch_of_another_shape_or_dtype_is_joined_too(fp8_small):
    table = nc.EmbeddingTable(fp8_small, scale=SCALE, total_rows=TOTAL)
    table.prefetch(random_ids(5, (10, 4)))
    ids = random_ids(6, (7, 4))
    np.testing.assert_array_equal(table.lookup(ids), expected(fp8_small, ids))
    table.prefetch(ids)
    result = table.lookup(ids, out_dtype=np.float32)
    np.testing.assert_array_equal(result, expected(fp8_small, ids, np.float32))


def test_repeated_prefetch_keeps_the_last(fp8_small):
    table = nc.EmbeddingTable(fp8_small, scale=SCALE, total_rows=TOTAL)
    first, second = random_ids(7), random_ids(8)
    table.prefetch(first)
    table.prefetch(second)
    np.testing.assert_array_equal(table.lookup(second), expected(fp8_small, second))
    np.testing.assert_array_equal(table.lookup(first), expected(fp8_small, first))


def test_staging_buffers_are_allocated_once_per_shape(fp8_small):
    table = nc.EmbeddingTable(fp8_small, scale=SCALE, total_rows=TOTAL)
    results = []
    for seed in range(3):
        ids = random_ids(seed)
        table.prefetch(ids)
        result = table.lookup(ids)
        np.testing.assert_array_equal(result, expected(fp8_small, ids))
        results.append(result)
    assert results[0] is results[1] is results[2]  # the one staging buffer of this shape
    table.prefetch(random_ids(0, (5, 4)))
    assert table.lookup(random_ids(0, (5, 4))) is not results[0]
    fresh = table.lookup(random_ids(9))  # no prefetch: a new array
    assert fresh is not results[0]


def test_host_staging_buffers_do_not_pile_up(fp8_small):
    """Batch sizes change from step to step: the host keeps only the latest few buffers."""
    from ngram_cupy.runtime.backends import HOST
    from ngram_cupy.tables.prefetch import STAGING_SHAPES as HOST_BUFFER_SHAPES

    table = nc.EmbeddingTable(fp8_small, scale=SCALE, total_rows=TOTAL)
    kept = []
    for tokens in range(1, 4 * HOST_BUFFER_SHAPES):
        ids = random_ids(tokens, (tokens, 4))
        table.prefetch(ids)
        kept.append((ids, table.lookup(ids)))  # each a staging buffer, of its own shape
    assert len(table.prefetcher.buffers(HOST)) <= HOST_BUFFER_SHAPES
    for ids, result in kept:
        np.testing.assert_array_equal(result, expected(fp8_small, ids))


def test_out_is_written_by_prefetch_and_lookup(fp8_small):
    table = nc.EmbeddingTable(fp8_small, scale=SCALE, total_rows=TOTAL)
    ids = random_ids(10)
    out = np.zeros((33, 32), ml_dtypes.bfloat16)
    table.prefetch(ids, out=out)
    assert table.lookup(ids, out=out) is out
    np.testing.assert_array_equal(out, expected(fp8_small, ids))
    other = np.zeros_like(out)  # prefetched into staging, looked up into the caller's buffer
    ids2 = random_ids(11)
    table.prefetch(ids2)
    assert table.lookup(ids2, out=other) is other
    np.testing.assert_array_equal(other, expected(fp8_small, ids2))
    stale = random_ids(12)  # prefetched into one buffer, asked for other ids into another
    table.prefetch(ids, out=out)
    table.lookup(stale, out=other)
    np.testing.assert_array_equal(other, expected(fp8_small, stale))


def test_an_error_in_the_worker_surfaces_at_lookup(fp8_small, monkeypatch):
    table = nc.EmbeddingTable(fp8_small, scale=SCALE, total_rows=TOTAL)

    def broken(*args, **kwargs):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(gather_numba, "gather_rows", broken)
    table.prefetch(random_ids(13))
    with pytest.raises(RuntimeError, match="disk on fire"):
        table.lookup(random_ids(13))
    monkeypatch.undo()
    ids = random_ids(14)  # the failed prefetch is gone; the table works again
    np.testing.assert_array_equal(table.lookup(ids), expected(fp8_small, ids))
    monkeypatch.setattr(gather_numba, "gather_rows", broken)
    table.prefetch(ids)
    with pytest.raises(RuntimeError, match="disk on fire"):  # or at the next prefetch
        table.prefetch(ids)


def test_the_worker_runs_beside_the_caller(fp8_small, monkeypatch):
    """The gather runs on another thread while prefetch has already returned."""
    table = nc.EmbeddingTable(fp8_small, scale=SCALE, total_rows=TOTAL)
    started, release = threading.Event(), threading.Event()
    real = gather_numba.gather_rows

    def gated(*args, **kwargs):
        started.set()
        release.wait(5)
        return real(*args, **kwargs)

    monkeypatch.setattr(gather_numba, "gather_rows", gated)
    ids = random_ids(15)
    table.prefetch(ids)
    assert started.wait(5)  # prefetch returned while the gather waits on its own thread
    release.set()
    np.testing.assert_array_equal(table.lookup(ids), expected(fp8_small, ids))


def test_the_worker_never_runs_a_parallel_gather(fp8_small, monkeypatch):
    """Numba's workqueue threading layer aborts the process when two threads run parallel
    kernels at once: the worker's gathers are serial, even for batches that get threads on the
    caller's side."""
    from mapped_table import MappedTable

    calls = []
    real = gather_numba.gather_rows

    def spy(*args, parallel=None, **kwargs):
        calls.append((threading.current_thread() is threading.main_thread(), parallel))
        return real(*args, parallel=parallel, **kwargs)

    monkeypatch.setattr(gather_numba, "gather_rows", spy)
    ids = random_ids(30, (gather_numba.PARALLEL_MIN_ROWS // 4, 4))
    mapped = MappedTable([(0, fp8_small[:90]), (90, fp8_small[90:])], 8, fp8_small.dtype, SCALE,
                         0, 200, TOTAL)
    for table in (nc.EmbeddingTable(fp8_small, scale=SCALE, total_rows=TOTAL), mapped):
        calls.clear()
        table.prefetch(ids)
        np.testing.assert_array_equal(table.lookup(ids), expected(fp8_small, ids))
        worker = [parallel for on_main, parallel in calls if not on_main]
        assert worker and all(parallel is False for parallel in worker), calls


def _use_after_fork(table, ids, expect) -> None:
    """In the forked child: lookups, a new prefetch and close must work (exit 0), not hang."""
    table.lookup(ids)  # the parent's prefetch, in flight at the fork, is dropped
    table.prefetch(ids)
    ok = np.array_equal(table.lookup(ids), expect)
    table.close()
    os._exit(0 if ok else 1)


def test_a_forked_child_does_not_wait_for_the_parents_worker(fp8_small):
    """After a fork the worker thread exists only in the parent: a child waiting for it (or
    queueing work for it) would hang forever."""
    table = nc.EmbeddingTable(fp8_small, scale=SCALE, total_rows=TOTAL)
    ids = random_ids(31)
    release = threading.Event()
    in_flight = Pending(ids=ids, rows=None, out_code=-1)
    table.prefetcher.threads.start(in_flight, release.wait)
    child = multiprocessing.get_context("fork").Process(
        target=_use_after_fork, args=(table, ids, expected(fp8_small, ids)))
    child.start()
    child.join(timeout=60)
    release.set()
    if child.is_alive():
        child.kill()
        child.join()
    assert child.exitcode == 0, "the forked child hung or failed"
    table.lookup(ids)  # the parent's own prefetch is joined as usual


def test_prefetch_argument_errors_are_raised_at_once(fp8_small):
    table = nc.EmbeddingTable(fp8_small, scale=SCALE, total_rows=TOTAL)
    with pytest.raises(ValueError, match="ids must be 2-D"):
        table.prefetch(np.zeros(3, np.int64))
    with pytest.raises(ValueError, match="out must have shape"):
        table.prefetch(np.zeros((3, 1), np.int64), out=np.zeros((3, 3), ml_dtypes.bfloat16))


def test_close_finishes_the_worker(fp8_small):
    table = nc.EmbeddingTable(fp8_small, scale=SCALE, total_rows=TOTAL)
    table.prefetch(random_ids(16))
    table.close()
    ids = random_ids(17)  # CPU tables stay usable after close (nothing was pinned)
    np.testing.assert_array_equal(table.lookup(ids), expected(fp8_small, ids))


def test_embedding_start_prefetch_then_forward(fp8_small):
    config = nc.NGramConfig(vocab_size=60, ngram_size=3, heads_per_ngram=2,
                            ngram_vocab_size_base=40, eos_token_id=1, embedding_dim=32)
    layout = nc.layer_layout(config, 0)
    rng = np.random.default_rng(18)
    full = (rng.standard_normal((layout.padded_rows, 8)) * 4).astype(ml_dtypes.float8_e4m3fn)
    layer = nc.NGramEmbedding(layout, nc.EmbeddingTable(full, scale=SCALE))
    tokens = rng.integers(0, 60, 12)
    starts = np.array([0, 5, 12])
    context = rng.integers(0, 60, (2, 2))
    ids = nc.compute_ngram_ids(layout, tokens, starts, context)
    layer.start_prefetch(tokens, starts, context)
    np.testing.assert_array_equal(layer.forward(tokens, starts, context), expected(full, ids))
    other = rng.integers(0, 60, 12)  # a stale prefetch: other tokens than prefetched
    layer.start_prefetch(tokens, starts, context)
    np.testing.assert_array_equal(
        layer(other, starts, context),
        expected(full, nc.compute_ngram_ids(layout, other, starts, context)))


@pytest.mark.skipif(HAS_GPU, reason="checks the error seen without a GPU")
def test_pinning_without_a_gpu_is_a_clear_error():
    with pytest.raises(RuntimeError, match="could not page-lock 4,096 bytes.*CUDA device"):
        PinnedBuffer(4096)


# ---------------------------------------------------------------- on a GPU (skipped without one)


def device_tables(fp8_small):
    """The same rows resident on the GPU and pinned on the host."""
    return (nc.EmbeddingTable(fp8_small, scale=SCALE, placement="gpu"),
            nc.EmbeddingTable(fp8_small, scale=SCALE, placement="host"))


@pytest.fixture
def side_stream():
    """A non-blocking CuPy stream (graphs cannot be captured on the legacy default stream)."""
    import cupy

    return cupy.cuda.Stream(non_blocking=True)


@pytest.mark.gpu
def test_host_table_is_pinned_mapped_and_exactly_sized(fp8_small):
    import cupy

    table = nc.EmbeddingTable(fp8_small, scale=SCALE, placement="host")
    assert table.pinned and table.host_view.nbytes == fp8_small.nbytes == table.nbytes
    attributes = cupy.cuda.runtime.pointerGetAttributes(table.host_view.ctypes.data)
    assert attributes.type == cupy.cuda.runtime.memoryTypeHost
    table.host_view[0] = fp8_small[1]  # writable in place, seen by the GPU at once
    ids = cupy.zeros((1, 1), cupy.int64)
    np.testing.assert_array_equal(table.lookup(ids).get().view(ml_dtypes.bfloat16),
                                  expected(fp8_small, [[1]]))


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 256, 4099])
def test_host_lookups_equal_gpu_resident_ones(fp8_small, num_tokens):
    import cupy

    gpu, host = device_tables(fp8_small)
    ids = cupy.asarray(random_ids(num_tokens, (num_tokens, 16)))
    resident = gpu.lookup(ids).get()
    np.testing.assert_array_equal(host.lookup(ids).get(), resident)
    host.prefetch(ids)
    np.testing.assert_array_equal(host.lookup(ids).get(), resident)
    host.dedup = True
    np.testing.assert_array_equal(host.lookup(ids).get(), resident)
    np.testing.assert_array_equal(resident.view(ml_dtypes.bfloat16),
                                  expected(fp8_small, ids.get()))


@pytest.mark.gpu
def test_stale_prefetch_on_the_side_stream(fp8_small, side_stream):
    import cupy

    host, stream = nc.EmbeddingTable(fp8_small, scale=SCALE, placement="host"), side_stream
    with stream:  # inputs made on the stream: a non-blocking one does not wait for the null one
        prefetched = cupy.asarray(random_ids(20, (512, 16)))
        asked = prefetched.copy()
        asked[::5] = cupy.asarray(random_ids(21, (103, 16)))
        host.prefetch(prefetched)
        prefetched[...] = 0  # overwritten on the caller's stream after the prefetch: harmless
        result = host.lookup(asked)
    stream.synchronize()
    np.testing.assert_array_equal(result.get().view(ml_dtypes.bfloat16),
                                  expected(fp8_small, asked.get()))


@pytest.mark.gpu
def test_prefetch_and_lookup_replay_in_a_cuda_graph(fp8_small, side_stream):
    import cupy

    host, stream = nc.EmbeddingTable(fp8_small, scale=SCALE, placement="host"), side_stream
    with stream:
        ids = cupy.asarray(random_ids(22, (64, 16)))
        out = cupy.empty((64, 128), cupy.uint16)
        host.prefetch(ids)  # warm-up: compiles and allocates the staging buffers
        host.lookup(ids, out=out)
        stream.begin_capture()
        host.prefetch(ids)
        host.lookup(ids, out=out)
        graph = stream.end_capture()
        for seed in (23, 24):
            ids[...] = cupy.asarray(random_ids(seed, (64, 16)))
            out[...] = 0
            graph.launch(stream)
            stream.synchronize()
            np.testing.assert_array_equal(out.get().view(ml_dtypes.bfloat16),
                                          expected(fp8_small, ids.get()))


@pytest.mark.gpu
def test_close_releases_the_registration(fp8_small):
    import cupy

    table = nc.EmbeddingTable(fp8_small, scale=SCALE, placement="host")
    pointer = table.host_view.ctypes.data
    table.prefetch(cupy.asarray(random_ids(25)))
    table.close()
    with pytest.raises(cupy.cuda.runtime.CUDARuntimeError):  # no longer registered
        cupy.cuda.runtime.hostUnregister(pointer)
    buffer = PinnedBuffer(1 << 20)
    assert buffer.registered
    pointer = buffer.pointer
    del buffer  # garbage collection queues its release (no CUDA call inside a collection)
    gc.collect()
    assert release_deferred() == 0  # the queue drains at the next safe point
    with pytest.raises(cupy.cuda.runtime.CUDARuntimeError):
        cupy.cuda.runtime.hostUnregister(pointer)


@pytest.mark.gpu
def test_torch_stream_and_tensors(fp8_small):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    gpu, host = device_tables(fp8_small)
    ids = torch.randint(-5, 210, (40, 16), device="cuda")
    out = torch.empty(40, 128, dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        host.prefetch(ids, stream=stream)
        assert host.lookup(ids, out=out, stream=stream) is out
    stream.synchronize()
    resident = gpu.lookup(ids)  # torch ids: a torch tensor, not a CuPy array
    assert isinstance(resident, torch.Tensor) and resident.dtype == torch.bfloat16
    torch.cuda.synchronize()
    np.testing.assert_array_equal(out.view(torch.int16).cpu().numpy(),
                                  resident.view(torch.int16).cpu().numpy())



def test_collecting_a_table_never_waits_for_its_prefetch_worker(fp8_small):
    """The finaliser must not join the worker: run inside another thread's start (where a
    collection can happen), a join deadlocks. Here the worker is blocked until released, and a
    helper thread drops the last reference, so a regression fails instead of hanging."""
    holder = [nc.EmbeddingTable(fp8_small, scale=SCALE, total_rows=TOTAL)]
    threads, release = holder[0].prefetcher.threads, threading.Event()
    threads.start(Pending(ids=None, rows=None, out_code=0), release.wait)
    collected = threading.Event()

    def collect():
        holder.clear()  # the last reference: the finaliser runs here
        gc.collect()
        collected.set()

    collector = threading.Thread(target=collect, daemon=True)
    collector.start()
    collector.join(timeout=20)
    release.set()
    assert collected.is_set(), "collecting the table waited for its prefetch worker"
    assert threads._executor is None


# --- one table, several Python threads (issue 9) ------------------------------------------------


def test_silent_wrong_threads_sharing_one_embedding_with_prefetch_are_exact_or_refused(fp8_small):
    """Four threads prefetch and look up through one NGramEmbedding: every result is exact, and
    the only error is the RuntimeError of a second thread's prefetch while one is pending."""
    config = nc.NGramConfig(vocab_size=500, ngram_size=3, heads_per_ngram=2,
                            ngram_vocab_size_base=47, eos_token_id=1, embedding_dim=32)
    layout = nc.layer_layout(config, 0)
    rows = np.random.default_rng(3).standard_normal((layout.padded_rows, 8)).astype(np.float32)
    layer = nc.NGramEmbedding(layout, nc.EmbeddingTable(rows))
    rng = np.random.default_rng(4)
    batches = []
    for _ in range(6):
        tokens = rng.integers(0, 500, 40)
        starts = np.array([0, 17, 40])
        context = rng.integers(0, 500, (2, 2))
        ids = nc.compute_ngram_ids(layout, tokens, starts, context)
        batches.append(((tokens, starts, context), reference_lookup(rows, ids, 1.0, np.float32)))
    wrong, refused, other = [], [], []
    barrier = threading.Barrier(4)

    def work(worker: int) -> None:
        barrier.wait()
        for step in range(60):
            batch, want = batches[(worker + step) % len(batches)]
            try:
                if worker % 2 == 0 or step % 3 == 0:
                    layer.start_prefetch(*batch)
                got = layer(*batch)
                if not np.array_equal(got, want):
                    wrong.append((worker, step))
            except RuntimeError as e:
                refused.append(str(e))
            except Exception as e:  # noqa: BLE001 -- any other error fails the test below
                other.append(repr(e))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    layer.table.close()
    assert not wrong and not other, (wrong, other)
    assert all("pending on this table" in message for message in refused)


def test_a_pending_prefetch_is_joined_only_by_its_thread(fp8_small):
    table = nc.EmbeddingTable(fp8_small, scale=SCALE, total_rows=TOTAL)
    mine, theirs = random_ids(10), random_ids(11)
    table.prefetch(mine)
    results = {}

    def other_thread() -> None:
        results["lookup"] = table.lookup(theirs)  # gathers on its own, leaves mine pending
        try:
            table.prefetch(theirs)
        except RuntimeError as e:
            results["prefetch"] = str(e)

    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join()
    np.testing.assert_array_equal(results["lookup"], expected(fp8_small, theirs))
    assert "pending on this table" in results["prefetch"]
    np.testing.assert_array_equal(table.lookup(mine), expected(fp8_small, mine))
    table.prefetch(theirs)  # joined: free for the next prefetch, from any thread
    table.close()


def test_kept_staging_shapes_survive_any_number_of_other_shapes(fp8_small):
    """Bug 4: staging buffers are bounded on both sides; the batch sizes a CUDA graph captured
    are pinned with keep_staging and never dropped (the graph holds their addresses)."""
    from ngram_cupy.tables.prefetch import STAGING_SHAPES

    table = nc.EmbeddingTable(fp8_small, scale=SCALE, total_rows=TOTAL)
    table.keep_staging([5])
    table.prefetch(random_ids(40, (5, 4)))
    captured = table.lookup(random_ids(40, (5, 4)))
    for tokens in range(6, 6 + 3 * STAGING_SHAPES):
        table.prefetch(random_ids(tokens, (tokens, 4)))
        table.lookup(random_ids(tokens, (tokens, 4)))
    ids = random_ids(41, (5, 4))
    table.prefetch(ids)
    assert table.lookup(ids) is captured  # the same buffer, at the same address
    np.testing.assert_array_equal(captured, expected(fp8_small, ids))
    assert len(table.prefetcher.buffers(nc.runtime.backends.HOST)) <= STAGING_SHAPES + 2
    with pytest.raises(TypeError, match="num_tokens must be an integer"):
        table.keep_staging([2.5])


def test_buffers_drop_the_oldest_unpinned_shapes():
    from ngram_cupy.tables.prefetch import Buffers

    buffers = Buffers(np.empty, keep=2)
    first = buffers.get("rows", (1, 3), np.float32)
    buffers.pin([7])
    pinned = buffers.get("rows", (7, 3), np.float32)
    for size in (2, 3, 4):
        buffers.get("rows", (size, 3), np.float32)
    assert buffers.get("rows", (7, 3), np.float32) is pinned  # pinned: kept, not counted
    assert buffers.get("rows", (1, 3), np.float32) is not first  # dropped, made anew
    assert len(buffers) == 3


class FakeEvent:
    def record(self, stream):
        pass


class PrefetchStream:
    """Just the CuPy stream methods the stream prefetcher calls."""

    def __init__(self, capturing=False):
        self.capturing = capturing
        self.waited = 0

    def is_capturing(self):
        return self.capturing

    def wait_event(self, event):
        self.waited += 1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


def test_a_prefetch_captured_without_its_lookup_is_a_clear_error():
    """Bug 6: a prefetch inside a CUDA graph capture whose lookup is not captured leaves the
    side stream unjoined; the next join says what happened instead of a CUDA error."""
    from ngram_cupy.tables.prefetch import StreamPrefetcher

    prefetcher = StreamPrefetcher(stream=PrefetchStream(), event=FakeEvent)
    caller = PrefetchStream(capturing=True)
    prefetcher.start(caller, Pending(ids=None, rows=None, out_code=0), lambda: None)
    caller.capturing = False  # the capture ended without the lookup
    with pytest.raises(RuntimeError, match="captured in a CUDA graph without its lookup"):
        prefetcher.join(caller)
    assert prefetcher.join(caller) is None  # dropped: the table works on
    prefetcher.start(caller, Pending(ids=None, rows=None, out_code=0), lambda: None)
    caller.capturing = True  # issued outside, joined inside a capture
    with pytest.raises(RuntimeError, match="cannot join a prefetch issued outside"):
        prefetcher.join(caller)
    pending = Pending(ids=None, rows=None, out_code=0)
    prefetcher.start(caller, pending, lambda: None)  # both inside one capture: joined
    assert prefetcher.join(caller) is pending and caller.waited == 1


def test_the_prefetch_stream_is_made_on_the_ids_gpu(monkeypatch):
    """Bug: the private stream and its events were made on the current device; a lookup of
    ids on GPU 1 then waited on events of GPU 0's stream."""
    from fake_cupy import FakeCupy

    from ngram_cupy.tables import prefetch

    cupy = FakeCupy()
    monkeypatch.setattr(prefetch, "cupy_module", lambda: cupy)
    streams = prefetch.StreamPrefetcher(device=1)
    assert streams.device == 1 and streams.stream.device_id == 1 and cupy.current == 0
    assert ("event made", 1) in cupy.log and ("event made", 0) not in cupy.log
