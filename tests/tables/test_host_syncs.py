"""GPU lookups and prefetches never wait on the host: every host synchronisation the fake CuPy
sees is counted (``Stream.synchronize``, ``Event.synchronize``, a blocking ``get``, ``asnumpy``,
``runtime.deviceSynchronize``), for tables in GPU and pinned memory, the fused lookup, and (on a
GPU) the torch ops. Ids outside the table then surface at a later call or ``check()``."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from fake_cupy import DeviceArray, install_fake_cupy

import ngram_cupy as nc
from ngram_cupy.ids import fused_cuda, ids_cuda
from ngram_cupy.runtime.cuda_launch import NumbaKernel
from ngram_cupy.tables import gather_cupy
from ngram_cupy.tables.row_ids import UNCHECKED

ROWS, DIM = 40, 4


def note_bad_ids(grid, block, args, stream=None):
    """The gather kernel's id check: the least flat position of an id outside
    ``[0, total_rows)`` into the word (its last two parameters; see ``launch_plan``)."""
    ids, total_rows, bad = args[3].host.reshape(-1), int(args[-2]), args[-1]
    outside = np.flatnonzero((ids < 0) | (ids >= total_rows))
    if total_rows != UNCHECKED and outside.size:
        bad.host[0] = min(int(bad.host[0]), int(outside[0]))


@pytest.fixture
def fake_gpu(monkeypatch):
    """The fake CuPy in place of CuPy, with the gather kernel's id check as its launch."""
    cupy = install_fake_cupy(monkeypatch)
    monkeypatch.setattr(gather_cupy, "_kernel", lambda name, device: note_bad_ids)
    return cupy


def device_ids(cupy, seed, shape=(6, 2), high=ROWS):
    return DeviceArray(cupy, np.random.default_rng(seed).integers(0, high, shape), 0)


def placed_tables(cupy):
    """A table of each placement a GPU lookup reads: GPU memory, pinned host memory."""
    weight = np.random.default_rng(0).standard_normal((ROWS, DIM)).astype(np.float32)
    return {"gpu": nc.EmbeddingTable(DeviceArray(cupy, weight.copy(), 0), placement="gpu"),
            "pinned": nc.EmbeddingTable(weight, placement="pinned")}


@pytest.mark.parametrize("placement", ["gpu", "pinned"])
def test_lookups_and_prefetches_make_no_host_synchronisation(fake_gpu, placement):
    table = placed_tables(fake_gpu)[placement]
    assert table.pinned == (placement == "pinned")
    table.lookup(device_ids(fake_gpu, 1))  # warm-up: the table's bad-id word is made
    fake_gpu.syncs.clear()
    for seed in range(3):
        table.lookup(device_ids(fake_gpu, seed))
        table.start_prefetch(device_ids(fake_gpu, 10 + seed))
        assert fake_gpu.syncs == [], "start_prefetch waited on the host"
        table.lookup(device_ids(fake_gpu, 10 + seed))  # joins the prefetch
        table.start_prefetch(device_ids(fake_gpu, 20 + seed))
        table.lookup(device_ids(fake_gpu, 30 + seed))  # joins it; other ids re-gathered
    assert fake_gpu.syncs == []


def test_a_bad_id_surfaces_at_the_next_call_once_the_gpu_ran_it_or_at_check(fake_gpu):
    table = placed_tables(fake_gpu)["gpu"]
    bad = device_ids(fake_gpu, 2)
    bad.host[3, 1] = ROWS + 7  # flat position 7
    table.lookup(bad)  # queued: nothing waits for the kernel, nothing raised yet
    with pytest.raises(IndexError, match=r"rows \[0, 40\) \(the first at flat position 7"):
        table.lookup(device_ids(fake_gpu, 3))  # the GPU ran it: its copy's event is done
    table.lookup(device_ids(fake_gpu, 3))  # raised once
    fake_gpu.events_done = False  # the GPU has not run the bad lookup yet: nothing to raise
    table.start_prefetch(bad)
    table.lookup(device_ids(fake_gpu, 3))
    fake_gpu.syncs.clear()
    with pytest.raises(IndexError, match="flat position 7"):
        table.check()  # waits for the streams that looked the table up
    assert fake_gpu.syncs and "get" in fake_gpu.syncs
    table.check()


def test_a_captured_bad_id_surfaces_at_check(fake_gpu):
    """Inside a capture nothing is copied nor queried (a replay's word is read by ``check``);
    no word is made inside one (every replay would clear it)."""
    table = placed_tables(fake_gpu)["gpu"]
    table.lookup(device_ids(fake_gpu, 4))  # warm-up outside the capture: the word is made
    table.start_prefetch(device_ids(fake_gpu, 4))
    table.lookup(device_ids(fake_gpu, 4))  # a lookup that read a snapshot, outside the capture
    stream = fake_gpu.cuda.Stream(ptr=0xC)
    stream.capturing = True
    bad = device_ids(fake_gpu, 5)
    bad.host[0, 0] = -1
    fake_gpu.log.clear()
    table.lookup(bad, stream=stream)
    table.start_prefetch(bad, stream=stream)
    table.lookup(bad, stream=stream)  # joins it inside the capture
    stream.capturing = False
    recorded = set()
    for entry in fake_gpu.log:  # no event query; waits only for events recorded in the capture
        assert entry[0] != "query" and (entry[0] != "wait" or id(entry[2]) in recorded), entry
        if entry[0] == "record":
            recorded.add(id(entry[2]))
    with pytest.raises(IndexError, match="flat position 0"):
        table.check()
    fresh = placed_tables(fake_gpu)["gpu"]  # first looked up in a capture: no word, ids unchecked
    stream.capturing = True
    fresh.lookup(bad, stream=stream)
    stream.capturing = False
    assert not fresh.bad_ids.words
    fresh.check()


def test_the_next_prefetch_waits_for_the_lookup_that_read_its_snapshot(fake_gpu):
    """A lookup on stream A re-gathers against the prefetch's ids snapshot; the next prefetch,
    on stream B, overwrites that snapshot only after A's reads (an event; device-side)."""
    table = placed_tables(fake_gpu)["gpu"]
    first, second = fake_gpu.cuda.Stream(ptr=0xA), fake_gpu.cuda.Stream(ptr=0xB)
    ids = device_ids(fake_gpu, 6)
    table.start_prefetch(ids, stream=first)
    fake_gpu.log.clear()
    table.lookup(ids, stream=first)
    read = [entry[2] for entry in fake_gpu.log if entry[:2] == ("record", 0xA)][-1]
    table.start_prefetch(ids, stream=second)
    assert ("wait", 0xB, read) in fake_gpu.log and fake_gpu.syncs == []


def test_the_fused_lookup_makes_no_host_synchronisation(fake_gpu, monkeypatch):
    layout = nc.layer_layout(nc.NGramConfig(50, 3, 1, 7, 0, embedding_dim=16), 0)
    monkeypatch.setattr(NumbaKernel, "__call__", lambda *args, **kwargs: None)
    rows = DeviceArray(fake_gpu, np.zeros((layout.padded_rows, layout.head_dim), np.float32), 0)
    tokens = DeviceArray(fake_gpu, np.arange(8, dtype=np.int64), 0)
    starts = DeviceArray(fake_gpu, np.array([0, 8], np.int64), 0)
    context = DeviceArray(fake_gpu, np.zeros((1, 2), np.int64), 0)
    out = DeviceArray(fake_gpu, np.empty((8, layout.num_heads * layout.head_dim), np.float32), 0)
    stream = fake_gpu.cuda.get_current_stream()

    def fused(table_rows=rows):  # as NGramEmbedding(..., fused=True) calls it, with no table
        fused_cuda.fused_lookup_cuda(layout, table_rows, nc.formats.FORMATS[0], 0, None, tokens,
                                     starts, context, out, 0, None, stream, None, None,
                                     layout.padded_rows)

    fused()  # warm-up: the layer's constants and the placeholders are uploaded once
    fake_gpu.syncs.clear()
    fused()
    fused()
    assert fake_gpu.syncs == []
    # Callers passing no table's words get their rows' own: a bad id one model's call noted
    # is raised by that model's next call, never by another model's.
    other = DeviceArray(fake_gpu, np.zeros((layout.padded_rows, layout.head_dim), np.float32), 0)
    fused_cuda.unowned_bad_ids(rows, layout.padded_rows).words[0].word.host[0] = 5
    fused()  # its kernel noted 5: copied to the host word behind it
    fused(other)
    with pytest.raises(IndexError, match="flat position 5"):
        fused()
    fused_cuda.UNOWNED_BAD_IDS.clear()
    ids_cuda.device_params.cache_clear()  # made with the fake CuPy: not for later tests
    fused_cuda.placeholder_ids.cache_clear()
    fused_cuda.device_unchecked_word.cache_clear()


@pytest.mark.gpu
def test_on_a_gpu_every_call_returns_while_the_gpu_is_busy():
    """On hardware: each call returns while the GPU still runs a long kernel queued before it on
    the caller's stream (a host synchronisation, of any stream that waits for it, would wait
    for that kernel too): table lookups (GPU and pinned memory), a prefetch and the lookup that
    joins it, the fused lookup, and the torch ops by their public names."""
    import torch

    from ngram_cupy.torch import NGramEmbeddingModule

    config = nc.NGramConfig(vocab_size=60, ngram_size=3, heads_per_ngram=2,
                            ngram_vocab_size_base=40, eos_token_id=1, embedding_dim=32)
    layout = nc.layer_layout(config, 0)
    module = NGramEmbeddingModule(config, 0, placement="gpu", weight_dtype=torch.bfloat16)
    weight = torch.randn(layout.padded_rows, layout.head_dim, device="cuda")
    gpu_table = nc.EmbeddingTable(weight, placement="gpu")
    pinned_table = nc.EmbeddingTable(weight.cpu().numpy(), placement="pinned")
    tokens = torch.randint(0, 60, (64,), device="cuda")
    starts = torch.tensor([0, 30, 64], device="cuda")
    context = torch.zeros((2, 2), dtype=torch.int64, device="cuda")
    ids = torch.randint(0, layout.padded_rows, (64, layout.num_heads), device="cuda")
    out = torch.empty((64, layout.num_heads * layout.head_dim), dtype=torch.bfloat16,
                      device="cuda")
    ops = torch.ops.ngram_cupy
    calls = {
        "gpu lookup": lambda: gpu_table.lookup(ids),
        "pinned lookup": lambda: pinned_table.lookup(ids),
        "prefetch": lambda: gpu_table.start_prefetch(ids),
        "joining lookup": lambda: gpu_table.lookup(ids),
        "fused": lambda: nc.NGramEmbedding(layout, gpu_table, fused=True)(tokens, starts,
                                                                           context),
        "ngram_ids op": lambda: ops.ngram_ids(module.handle, tokens, starts, context),
        "prefetch_ op": lambda: ops.prefetch_(module.handle, ids, out),
        "lookup_ op": lambda: ops.lookup_(module.handle, ids, out),
    }
    for call in calls.values():  # compiles, uploads and bad-id words first
        call()
    waited = []
    for name, call in calls.items():
        torch.cuda.synchronize()
        torch.cuda._sleep(1 << 31)  # about a second of GPU cycles on torch's current stream
        busy = torch.cuda.Event()
        busy.record()
        call()
        if busy.query():
            waited.append(name)
        torch.cuda.synchronize()
    assert waited == []
    gpu_table.check()
    bad = ids.clone()
    bad[5, 1] = layout.padded_rows + 3
    gpu_table.lookup(bad)
    with pytest.raises(IndexError, match=f"flat position {5 * layout.num_heads + 1} "):
        gpu_table.check()
    torch.cuda.synchronize()
    gpu_table.lookup(bad)  # the GPU has run it: the next call raises
    torch.cuda.synchronize()
    with pytest.raises(IndexError, match="flat position"):
        gpu_table.lookup(ids)


def test_check_on_a_cpu_table_needs_no_cupy(monkeypatch):
    """``check()`` after a step works on every table: one no GPU lookup used has no bad-id
    word, so CuPy (absent here) is never asked for."""
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy fails
    table = nc.EmbeddingTable(np.ones((ROWS, DIM), np.float32))
    table.lookup(np.array([[1, 2]]))
    table.check()
    with pytest.warns(DeprecationWarning, match=r"check_errors\(\) is deprecated: call check"):
        table.check_errors()  # the name check() had before


def test_a_word_is_cleared_after_every_copy_of_it_on_its_own_gpu(fake_gpu):
    """The raising call clears the word on its GPU's current stream, after waiting (device-side)
    for the copy events of every stream that noted into it: a note another stream's kernel
    made before its copy is not erased unseen."""
    table = placed_tables(fake_gpu)["gpu"]
    first, second = fake_gpu.cuda.Stream(ptr=0xA), fake_gpu.cuda.Stream(ptr=0xB)
    bad = device_ids(fake_gpu, 7)
    bad.host[0, 1] = -3
    fake_gpu.events_done = False
    table.lookup(bad, stream=first)
    table.lookup(device_ids(fake_gpu, 8), stream=second)
    entry = table.bad_ids.words[0]
    entry.word.fill = lambda value: fake_gpu.log.append(
        ("fill", fake_gpu.cuda.get_current_stream().ptr, fake_gpu.current))
    fake_gpu.events_done = True
    with fake_gpu.cuda.Device(1):  # the raising call runs while another GPU is current
        with pytest.raises(IndexError, match="flat position 1"):
            table.lookup(device_ids(fake_gpu, 9), stream=second)
    fill = next(entry for entry in fake_gpu.log if entry[0] == "fill")
    _, stream, device = fill
    waited = {id(entry[2]) for entry in fake_gpu.log[:fake_gpu.log.index(fill)]
              if entry[:2] == ("wait", stream)}
    assert device == 0 and waited >= {id(event) for event in entry.copies.values()}


def test_a_prefetch_waits_for_the_last_reader_of_its_own_shape(fake_gpu):
    """One read event per snapshot shape: a lookup on stream X reads the snapshot of one shape,
    one on Y another shape's; the next prefetch of the first shape, on Z, waits for X's reads."""
    table = placed_tables(fake_gpu)["gpu"]
    x, y, z = (fake_gpu.cuda.Stream(ptr=ptr) for ptr in (0xA, 0xB, 0xD))
    first, second = device_ids(fake_gpu, 11), device_ids(fake_gpu, 12, shape=(4, 2))
    table.start_prefetch(first, stream=z)
    table.lookup(first, stream=x)  # reads the (6, 2) snapshot on X
    table.start_prefetch(second, stream=x)
    table.lookup(second, stream=y)  # reads the (4, 2) snapshot on Y
    start = len(fake_gpu.log)
    table.start_prefetch(first, stream=z)  # overwrites the (6, 2) snapshot X read
    last_on = {}  # an event -> the stream it was last recorded on, as of each wait
    read_by_x_waited = False
    for index, entry in enumerate(fake_gpu.log):
        if entry[0] == "record":
            last_on[id(entry[2])] = entry[1]
        elif index >= start and entry[:2] == ("wait", 0xD):
            read_by_x_waited |= last_on.get(id(entry[2])) == 0xA
    assert read_by_x_waited and fake_gpu.syncs == []
