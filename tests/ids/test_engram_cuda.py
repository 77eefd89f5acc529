"""The Engram GPU kernels on the CPU: simulator runs against the plain reference (bounds-checked
arrays), garbage inputs staying in bounds, the public device path on stand-in arrays, and PTX."""

from __future__ import annotations

import sys

import engram_cases
import numpy as np
import pytest
import test_ids_cuda
from numba import types

import ngram_cupy as nc
from ngram_cupy.hashing import engram_reference as reference
from ngram_cupy.ids import engram_cuda
from ngram_cupy.runtime.cuda_launch import NumbaKernel


def simulated_ids(layout, block=4, **batch):
    """Ids from the simulated kernel (absent lookback and masks as empty arrays)."""
    num_tokens, width = len(batch["input_ids"]), layout.ngram_size - 1
    out = np.full((num_tokens, layout.num_layers * layout.num_heads), -7, dtype=np.int32)
    lookback = batch.get("lookback_token_ids")
    dead, lookback_dead = batch.get("dead_mask"), batch.get("lookback_dead_mask")
    engram_cuda.launch_engram_ids(
        layout, batch["input_ids"], batch["positions"], batch["query_start_loc"],
        np.zeros(0, np.uint8) if dead is None else dead.view(np.uint8),
        np.zeros((0, width), np.int64) if lookback is None else lookback,
        np.zeros((0, width), np.uint8) if lookback_dead is None else lookback_dead.view(np.uint8),
        layout.token_map, engram_cuda.engram_params(layout), out, block=block)
    return out.reshape(num_tokens, layout.num_layers, layout.num_heads)


def test_simulated_golden_synthetic_map(simulate):
    layout, case = engram_cases.load_golden("synthetic")
    for batch in case["batches"]:
        args, expected = engram_cases.golden_batch(batch)
        np.testing.assert_array_equal(simulated_ids(layout, **args), expected)


@pytest.mark.parametrize("shape", engram_cases.SHAPES, ids=str)
def test_simulated_random_batches_equal_the_reference(simulate, shape):
    rng = np.random.default_rng(sum(shape))
    layout = engram_cases.small_layout(rng, shape)
    for num_tokens, num_requests, block in [(11, 3, 4), (9, 1, 8), (13, 5, 4)]:
        batch = engram_cases.random_batch(rng, layout, num_tokens, num_requests, 0.2)
        expected = reference.compute_engram_ids(layout, **batch)
        np.testing.assert_array_equal(simulated_ids(layout, block, **batch), expected)
        plain = {name: batch[name] for name in ("input_ids", "positions", "query_start_loc")}
        np.testing.assert_array_equal(simulated_ids(layout, block, **plain),
                                      reference.compute_engram_ids(layout, **plain))


def test_simulated_kernel_stays_in_bounds_on_garbage(simulate):
    """Unchecked GPU inputs (request starts, positions, tokens past the map, lookback values):
    no access outside any array, every id inside its head's rows."""
    rng = np.random.default_rng(21)
    layout = engram_cases.small_layout(rng, (3, 2, 2))
    low = layout.head_offsets
    high = layout.head_offsets + layout.head_sizes
    big = np.iinfo(np.int64)
    for starts in ([5], [-3, 2], [big.max, big.min, 0], [9, 4, 30, 2, -1], [0, 2, 1, 100]):
        starts = np.array(starts, dtype=np.int64)
        batch = engram_cases.random_batch(rng, layout, 7, max(len(starts) - 1, 1))
        batch["query_start_loc"] = starts
        batch["input_ids"][::2] = rng.integers(big.min, big.max, 4)
        batch["positions"] = rng.integers(-5, 50, 7)
        batch["lookback_token_ids"][0] = [big.min, big.max]
        ids = simulated_ids(layout, **batch)
        assert np.all((ids >= low) & (ids < high)), starts


def test_simulated_advance_lookback_equals_the_reference(simulate):
    rng = np.random.default_rng(4)
    layout = engram_cases.small_layout(rng, (4, 1, 1))
    batch = engram_cases.random_batch(rng, layout, 12, 4)
    starts = batch["query_start_loc"]
    for values, old, fill in ((batch["input_ids"], batch["lookback_token_ids"], np.int64(-1)),
                              (batch["dead_mask"], batch["lookback_dead_mask"], np.bool_(False))):
        expected = reference.advance_engram_lookback(layout, values, starts, old[:4])
        in_place = old.copy()
        engram_cuda.launch_advance_lookback(values, starts, in_place, fill, in_place[:4])
        np.testing.assert_array_equal(in_place[:4], expected)


class StandIn(test_ids_cuda.StandInArray):
    """The stand-in CuPy array, with the views the Engram device path takes."""

    def view(self, dtype):
        return StandIn(self.host.view(dtype))

    def reshape(self, *shape):
        return StandIn(self.host.reshape(*shape))

    def __getitem__(self, index):
        return StandIn(self.host[index])


def test_public_functions_take_the_device_path(simulate, monkeypatch):
    cupy = test_ids_cuda.stand_in_cupy()
    cupy.ndarray = StandIn
    cupy.ascontiguousarray = lambda a: StandIn(np.ascontiguousarray(a.host))
    cupy.empty = lambda shape, dtype: StandIn(np.full(shape, -1).astype(dtype))
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    launch = NumbaKernel.__call__  # the simulator, on the stand-ins' memory

    def on_host_memory(self, grid, block, args, stream=None):
        args = tuple(a.host if isinstance(a, StandIn) else a for a in args)
        return launch(self, grid, block, args, stream)

    monkeypatch.setattr(NumbaKernel, "__call__", on_host_memory)
    monkeypatch.setattr(engram_cuda, "device_constants", lambda layout, device: (
        layout.token_map, engram_cuda.engram_params(layout)))
    layout, case = engram_cases.load_golden("synthetic")
    args, expected = engram_cases.golden_batch(case["batches"][0])
    device = {name: StandIn(value) for name, value in args.items()}
    ids = nc.compute_engram_ids(layout, **device)
    assert isinstance(ids, StandIn)
    np.testing.assert_array_equal(ids.host, expected)
    plain = {name: device[name] for name in ("input_ids", "positions", "query_start_loc")}
    np.testing.assert_array_equal(nc.compute_engram_ids(layout, **plain).host,
                                  reference.compute_engram_ids(layout, **{
                                      name: args[name] for name in plain}))
    rolled = nc.advance_engram_lookback(layout, device["input_ids"], device["query_start_loc"],
                                        device["lookback_token_ids"])
    np.testing.assert_array_equal(rolled.host, reference.advance_engram_lookback(
        layout, args["input_ids"], args["query_start_loc"], args["lookback_token_ids"]))
    short = StandIn(args["lookback_token_ids"][:, :2].copy())
    with pytest.raises(ValueError, match="lookback_token_ids must have shape"):
        nc.compute_engram_ids(layout, **{**device, "lookback_token_ids": short})


def test_engram_kernel_ptx_is_division_free():
    kernel_builds = pytest.importorskip("kernel_builds")
    kernel, _ = engram_cuda.engram_kernel(3, 8, 2)

    def array(dtype, ndim):
        return types.Array(dtype, ndim, "C")

    signature = (array(types.int64, 1), array(types.int64, 1), array(types.int64, 1),
                 array(types.uint8, 1), array(types.int64, 2), array(types.uint8, 2),
                 array(types.int32, 1), types.int64, array(types.int64, 3),
                 array(types.int32, 2))
    code = kernel_builds.build(kernel.py_func, signature, (9, 0)).ptx
    assert "mul.hi.u64" in code  # the reciprocal modulo
    assert not test_ids_cuda.DIVISION_64.findall(code)
    assert "bar.sync" in code and "st.shared.u64" in code


# ---------------------------------------------------------------- on a GPU


@pytest.mark.gpu
@pytest.mark.parametrize("shape", engram_cases.SHAPES, ids=str)
@pytest.mark.parametrize("num_tokens, num_requests", [(0, 1), (1, 1), (300, 64), (70_001, 9)])
def test_gpu_equals_cpu(shape, num_tokens, num_requests):
    import cupy

    rng = np.random.default_rng(num_tokens)
    layout = engram_cases.small_layout(rng, shape)
    batch = engram_cases.random_batch(rng, layout, num_tokens, num_requests)
    device = {name: cupy.asarray(value) for name, value in batch.items()}
    ids = nc.compute_engram_ids(layout, **device)
    assert isinstance(ids, cupy.ndarray) and ids.dtype == np.int32
    np.testing.assert_array_equal(ids.get(), nc.compute_engram_ids(layout, **batch))
    for values, old in (("input_ids", "lookback_token_ids"), ("dead_mask", "lookback_dead_mask")):
        rolled = nc.advance_engram_lookback(layout, device[values], device["query_start_loc"],
                                            device[old])
        np.testing.assert_array_equal(rolled.get(), nc.advance_engram_lookback(
            layout, batch[values], batch["query_start_loc"], batch[old]))


@pytest.mark.gpu
def test_gpu_torch_in_torch_out_on_a_side_stream():
    torch = pytest.importorskip("torch")
    layout, case = engram_cases.load_golden("synthetic")
    args, expected = engram_cases.golden_batch(case["batches"][0])
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        tensors = {name: torch.from_numpy(value).cuda() for name, value in args.items()}
        ids = nc.compute_engram_ids(layout, **tensors)
    assert ids.is_cuda and ids.dtype == torch.int32
    stream.synchronize()
    np.testing.assert_array_equal(ids.cpu().numpy(), expected)


def test_simulated_kernel_reads_no_other_request_on_gapped_positions(simulate):
    """A gap inside a request (unchecked on the GPU) gives meaningless ids for that request,
    never ones that read another request's tokens: changing request 0 leaves request 1 as is."""
    rng = np.random.default_rng(31)
    layout = engram_cases.small_layout(rng, (3, 2, 2))
    batch = engram_cases.random_batch(rng, layout, 6, 2)
    batch.update(positions=np.array([1, 2, 3, 5, 100, 101]),
                 query_start_loc=np.array([0, 3, 6]), dead_mask=None, lookback_dead_mask=None)
    first = simulated_ids(layout, **batch)
    batch["input_ids"] = batch["input_ids"].copy()
    batch["input_ids"][:3] = (batch["input_ids"][:3] + 1) % layout.vocab_size
    np.testing.assert_array_equal(simulated_ids(layout, **batch)[3:], first[3:])
    contiguous = {**batch, "positions": np.array([1, 2, 3, 99, 100, 101])}
    np.testing.assert_array_equal(simulated_ids(layout, **contiguous),
                                  reference.compute_engram_ids(layout, **contiguous))
