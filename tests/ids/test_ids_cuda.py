"""The GPU ids and context kernels: simulator runs and PTX on the CPU; bit-exact runs on a GPU."""

from __future__ import annotations

import re
import sys
import types as pytypes

import kernel_builds
import numpy as np
import pytest
import simulator
from numba import cuda, types

import ngram_cupy as nc
from ngram_cupy.hashing import reference
from ngram_cupy.ids import ids_cuda
from ngram_cupy.runtime.cuda_launch import NumbaKernel

DIVISION_64 = re.compile(r"\b(?:div|rem)\.[us]64\b")


# ---------------------------------------------------------------- the kernels in the simulator


def gpu_ids(layout, tokens, starts, context, block):
    """Ids from the simulated kernel."""
    out = np.full((len(tokens), layout.num_heads), -1, dtype=np.int64)
    return ids_cuda.launch_ngram_ids(layout, tokens, starts, context,
                                     ids_cuda.layout_params(layout), out, block=block)


def assert_ids(layout, tokens, starts, context, block):
    expected = reference.compute_ngram_ids(layout, tokens, starts, context)
    np.testing.assert_array_equal(nc.compute_ngram_ids(layout, tokens, starts, context), expected)
    np.testing.assert_array_equal(gpu_ids(layout, tokens, starts, context, block), expected)


def test_simulated_ids_equal_the_golden_vectors(simulate, golden):
    layout, _, batches = golden
    for batch in batches:
        ids = gpu_ids(layout, batch["input_ids"], batch["query_start_loc"],
                      batch["ngram_context"], block=32)
        np.testing.assert_array_equal(ids, batch["ngram_ids"])


@pytest.mark.parametrize("layout", simulator.layouts(), ids=lambda lay: f"n{lay.ngram_size}")
def test_simulated_ids_on_random_batches(simulate, layout):
    """EOS-heavy, out-of-range and negative tokens; several blocks, a partial last block."""
    rng = np.random.default_rng(3 + layout.ngram_size)
    for num_tokens, num_requests, block in [(11, 3, 4), (9, 1, 8), (16, 5, 4)]:
        assert_ids(layout, *simulator.wild_batch(rng, layout, num_tokens, num_requests), block)


def test_simulated_ids_with_empty_requests_and_batches(simulate):
    layout = simulator.layouts()[1]
    tokens = np.arange(7, dtype=np.int64)
    context = np.full((6, 2), 5, dtype=np.int64)
    for starts in ([0, 0, 3, 3, 7, 7], [0, 7], [0, 0, 0, 0, 0, 7]):
        assert_ids(layout, tokens, np.array(starts), context, block=4)
    empty = gpu_ids(layout, tokens[:0], np.zeros(3, np.int64), context, block=4)
    assert empty.shape == (0, layout.num_heads)


def test_simulated_padded_batches_give_vllm_ids(simulate):
    """Tokens past ``query_start_loc[R]`` (a CUDA-graph size, SPEC 10.3): ids as if appended to
    the last request, across blocks and after an empty last request; the roll ignores them."""
    rng = np.random.default_rng(23)
    layout = simulator.layouts()[2]
    for num_tokens, num_requests, padding in [(5, 2, 7), (0, 1, 6), (9, 3, 1)]:
        tokens, starts, context = simulator.wild_batch(rng, layout, num_tokens, num_requests)
        padded = np.concatenate([tokens, rng.integers(0, 1000, padding)])
        extended = starts.copy()
        extended[-1] = padded.size
        want = reference.compute_ngram_ids(layout, padded, extended, context)
        np.testing.assert_array_equal(want[:num_tokens],
                                      reference.compute_ngram_ids(layout, tokens, starts, context))
        np.testing.assert_array_equal(gpu_ids(layout, padded, starts, context, block=4), want)
        rolled = np.zeros_like(context[:num_requests])
        ids_cuda.launch_advance_context(padded, starts, context, rolled)
        np.testing.assert_array_equal(rolled,
                                      reference.advance_context(layout, tokens, starts, context))


@pytest.mark.parametrize("dtypes", [(np.int32,) * 3, (np.int32, np.int64, np.int32),
                                    (np.int64, np.int32, np.int64)], ids=str)
def test_simulated_ids_on_int32_inputs(simulate, dtypes):
    rng = np.random.default_rng(5)
    layout = simulator.layouts()[2]
    assert_ids(layout, *simulator.wild_batch(rng, layout, 10, 3, dtypes, spare_rows=0), block=4)


def test_simulated_ids_of_the_released_config_at_decode(simulate, released_config):
    layout = nc.layer_layout(released_config, 0)
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, released_config.vocab_size, 6)
    tokens[2] = released_config.eos_token_id
    context = rng.integers(0, released_config.vocab_size, (8, 2))  # persistent: spare rows
    assert_ids(layout, tokens, np.arange(7), context, block=4)


def test_simulated_kernels_stay_in_bounds_on_garbage_query_start_loc(simulate):
    """Any values: no access outside the arrays, every id inside its head's rows."""
    rng = np.random.default_rng(11)
    layout = simulator.layouts()[1]
    low = layout.head_offsets
    high = layout.head_offsets + layout.head_sizes
    big = np.iinfo(np.int64)
    garbage = [[5], [-3, 2], [big.max, big.min, 0], [9, 4, 30, 2, -1], [0, 2, 1, 100]]
    garbage += [rng.integers(-20, 20, 6) for _ in range(3)]
    for starts in garbage:
        starts = np.array(starts, dtype=np.int64)
        num_requests = len(starts) - 1
        tokens, _, context = simulator.wild_batch(rng, layout, 7, max(num_requests, 1),
                                                    spare_rows=0)
        context = context[:num_requests]
        if num_requests:  # R = 0 with tokens is refused from shapes alone, before any launch
            ids = gpu_ids(layout, tokens, starts, context, block=4)
            assert np.all((ids >= low) & (ids < high)), starts
        out = np.zeros((num_requests, 2), dtype=np.int64)
        ids_cuda.launch_advance_context(tokens, starts, context, out)
        ids_cuda.launch_advance_context(tokens[:0], starts, context, out)


def test_the_simulator_checks_bounds(simulate):
    """The checked arrays are live: a kernel reading one past the end fails."""
    def read_past_the_end(values, out):
        out[0] = values[values.shape[0]]

    with pytest.raises(IndexError, match="outside axis 0"):
        NumbaKernel(read_past_the_end)(1, 1, (np.zeros(3, np.int64), np.zeros(1, np.int64)))


@pytest.mark.parametrize("layout", simulator.layouts()[::3], ids=lambda lay: f"n{lay.ngram_size}")
def test_simulated_advance_context_equals_the_reference(simulate, layout):
    rng = np.random.default_rng(13)
    for num_tokens, num_requests in [(0, 2), (1, 1), (9, 4)]:
        tokens, starts, context = simulator.wild_batch(rng, layout, num_tokens, num_requests)
        expected = reference.advance_context(layout, tokens, starts, context)
        out = np.zeros_like(context[:num_requests])
        ids_cuda.launch_advance_context(tokens, starts, context, out)
        np.testing.assert_array_equal(out, expected)
        ids_cuda.launch_advance_context(tokens, starts, context, context[:num_requests])
        np.testing.assert_array_equal(context[:num_requests], expected)  # in place


def test_simulated_chunked_decode_equals_whole(simulate):
    """Decode one token per step with contexts rolled on the device equals one prefill."""
    layout = simulator.layouts()[2]
    rng = np.random.default_rng(17)
    tokens, _, context = simulator.wild_batch(rng, layout, 8, 1, spare_rows=0)
    whole = reference.compute_ngram_ids(layout, tokens, [0, 8], context)
    state = context.copy()
    for t in range(8):
        one = tokens[t : t + 1]
        np.testing.assert_array_equal(gpu_ids(layout, one, np.array([0, 1]), state, block=4),
                                      whole[t : t + 1])
        ids_cuda.launch_advance_context(one, np.array([0, 1]), state, state)


class StandInArray:
    """A CuPy array stand-in over NumPy memory: what the device dispatch path touches."""

    def __init__(self, array: np.ndarray):
        self.host = array
        self.shape, self.strides, self.dtype = array.shape, array.strides, array.dtype
        self.ndim, self.flags = array.ndim, array.flags
        self.device = StandInContext()

    def __dlpack_device__(self):
        return 2, 0  # kDLCUDA

    def __getitem__(self, index):
        return StandInArray(self.host[index])


class StandInContext:
    """A CuPy device or stream stand-in."""

    id = ptr = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def stand_in_cupy():
    """A CuPy module stand-in, enough for ngram_ids' device path to run in the simulator."""
    cupy = pytypes.ModuleType("cupy")
    cupy.ndarray = StandInArray
    cupy.cuda = pytypes.SimpleNamespace(Stream=StandInContext, ExternalStream=StandInContext,
                                        get_current_stream=StandInContext,
                                        Device=lambda device=None: StandInContext())
    cupy.ascontiguousarray = lambda a: StandInArray(np.ascontiguousarray(a.host))
    cupy.empty = lambda shape, dtype: StandInArray(np.full(shape, -1, dtype=dtype))
    return cupy


def test_public_functions_take_the_device_path(simulate, monkeypatch):
    """compute_ngram_ids/advance_context on (stand-in) device arrays: dispatch, out=, errors."""
    monkeypatch.setitem(sys.modules, "cupy", stand_in_cupy())
    launch = NumbaKernel.__call__  # the simulator, on the stand-ins' memory

    def on_host_memory(self, grid, block, args, stream=None):
        args = tuple(a.host if isinstance(a, StandInArray) else a for a in args)
        return launch(self, grid, block, args, stream)

    monkeypatch.setattr(NumbaKernel, "__call__", on_host_memory)
    monkeypatch.setattr(ids_cuda, "device_params",
                        lambda layout, device: ids_cuda.layout_params(layout))
    rng = np.random.default_rng(19)
    layout = simulator.layouts()[1]
    tokens, starts, context = simulator.wild_batch(rng, layout, 9, 3)
    device = [StandInArray(a) for a in (tokens, starts, context)]
    ids = nc.compute_ngram_ids(layout, *device)
    assert isinstance(ids, StandInArray)
    expected = reference.compute_ngram_ids(layout, tokens, starts, context)
    np.testing.assert_array_equal(ids.host, expected)
    out = StandInArray(np.zeros_like(expected))
    assert nc.compute_ngram_ids(layout, *device, out=out) is out
    np.testing.assert_array_equal(out.host, expected)
    rolled = reference.advance_context(layout, tokens, starts, context)
    np.testing.assert_array_equal(nc.advance_context(layout, *device).host, rolled)
    nc.advance_context(layout, *device, out=device[2][:3])
    np.testing.assert_array_equal(context[:3], rolled)
    with pytest.raises(ValueError, match="query_start_loc holds no request"):
        nc.compute_ngram_ids(layout, device[0], StandInArray(np.zeros(1, np.int64)), device[2])


# ---------------------------------------------------------------- PTX, no GPU needed


@pytest.fixture
def ptx():
    """PTX of a kernel for a signature, compiled once per session (tests/kernel_builds.py)."""

    def compile_ptx(kernel, signature, cc):
        return kernel_builds.build(kernel.py_func, signature.args, cc).ptx

    return compile_ptx


def _vector(dtype):
    return types.Array(dtype, 1, "C")


def _matrix(dtype):
    return types.Array(dtype, 2, "C")


CCS = [(8, 0), (9, 0)]
# (ngram_size, heads_per_ngram, token and query_start_loc and context dtype): the released
# shape with both index widths, the smallest, and an odd head count with a non-power-of-2 row.
IDS_SPECIALISATIONS = [(3, 8, types.int64), (3, 8, types.int32), (2, 1, types.int64),
                       (5, 3, types.int32)]


@pytest.mark.parametrize("cc", CCS, ids=str)
@pytest.mark.parametrize("ngram_size, heads_per_ngram, dtype", IDS_SPECIALISATIONS, ids=str)
def test_ids_kernel_ptx_is_division_free(ptx, cc, ngram_size, heads_per_ngram, dtype):
    kernel, _ = ids_cuda.ids_kernel(ngram_size, heads_per_ngram)
    signature = types.void(_vector(dtype), _vector(dtype), _matrix(dtype), _matrix(types.int64),
                           types.int64, _matrix(types.int64))
    code = ptx(kernel, signature, cc)
    assert f".target sm_{cc[0]}{cc[1]}" in code
    assert "mul.hi.u64" in code  # the reciprocal modulo
    assert not DIVISION_64.findall(code)
    assert "bar.sync" in code and "st.shared.u64" in code  # ids staged for coalesced stores


@pytest.mark.parametrize("cc", CCS, ids=str)
@pytest.mark.parametrize("dtype", [types.int32, types.int64], ids=str)
def test_advance_context_kernel_ptx(ptx, cc, dtype):
    signature = types.void(_vector(dtype), _vector(dtype), _matrix(dtype), _matrix(dtype))
    code = ptx(ids_cuda.advance_context_kernel, signature, cc)
    assert f".target sm_{cc[0]}{cc[1]}" in code and not DIVISION_64.findall(code)


def test_the_division_check_sees_a_division(ptx):
    def divide(values):
        values[0] = values[0] % values[1]

    code = ptx(cuda.jit(divide), types.void(_vector(types.int64)), (9, 0))
    assert DIVISION_64.findall(code)


def test_staging_is_bank_conflict_free_and_fits_shared_memory():
    assert ids_cuda.staging_shape(16) == (128, 17)
    assert ids_cuda.staging_shape(15) == (128, 15)
    assert ids_cuda.staging_shape(48) == (64, 49)
    assert ids_cuda.staging_shape(100) == (32, 101)
    assert ids_cuda.staging_shape(16, block=4) == (4, 17)
    with pytest.raises(ValueError, match="at most 191 heads"):
        ids_cuda.staging_shape(192)


def test_layout_params_rows():
    layout = nc.layer_layout(nc.NGramConfig(97, 5, 1, 2, 5), 0)  # a head of size 2: magic 2**63
    params = ids_cuda.layout_params(layout)
    assert params.shape == (4, 5) and params.dtype == np.int64
    np.testing.assert_array_equal(params[0], layout.multipliers)
    np.testing.assert_array_equal(params[1, :4], layout.head_sizes)
    np.testing.assert_array_equal(params[2, :4].view(np.uint64), layout.head_magics)
    np.testing.assert_array_equal(params[3, :4], layout.head_offsets)


# ---------------------------------------------------------------- on a GPU (skipped without one)

RELEASED = nc.NGramConfig(
    vocab_size=248320, ngram_size=3, heads_per_ngram=8, ngram_vocab_size_base=20_000_000,
    eos_token_id=248044, embedding_dim=2560, make_ngram_vocab_size_divisible_by=512,
)
GPU_LAYOUTS = [nc.layer_layout(RELEASED, 0), nc.layer_layout(RELEASED, 3),
               nc.layer_layout(nc.NGramConfig(1000, 4, 3, 500, 999), 1),
               nc.layer_layout(nc.NGramConfig(50, 2, 1, 3, 0), 0)]


def random_typed_batch(layout, num_tokens, num_requests, dtype=np.int64, seed=0):
    """Valid tokens with 5% EOS and 2% arbitrary values of ``dtype``; random cuts."""
    rng = np.random.default_rng(seed)
    info = np.iinfo(dtype)

    def draw(shape):
        values = rng.integers(0, layout.config.vocab_size, shape)
        pick = rng.random(shape)
        values[pick < 0.05] = layout.eos_token_id
        values[pick > 0.98] = rng.integers(info.min, info.max, int((pick > 0.98).sum()))
        return values.astype(dtype)

    cuts = np.sort(rng.integers(0, num_tokens + 1, num_requests - 1))
    starts = np.concatenate([[0], cuts, [num_tokens]]).astype(dtype)
    return draw(num_tokens), starts, draw((num_requests + 3, layout.ngram_size - 1))


def on_device(*arrays):
    import cupy

    return tuple(cupy.asarray(a) for a in arrays)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", GPU_LAYOUTS, ids=lambda layout: f"n{layout.ngram_size}")
@pytest.mark.parametrize("num_tokens, num_requests", [(0, 1), (1, 1), (256, 256), (4099, 7),
                                                      (65_536 + 3, 64)])
@pytest.mark.parametrize("dtype", [np.int32, np.int64], ids=lambda d: np.dtype(d).name)
def test_gpu_equals_cpu(layout, num_tokens, num_requests, dtype):
    import cupy

    batch = random_typed_batch(layout, num_tokens, num_requests, dtype, seed=num_tokens)
    ids = nc.compute_ngram_ids(layout, *on_device(*batch))
    assert isinstance(ids, cupy.ndarray) and ids.dtype == np.int64
    np.testing.assert_array_equal(ids.get(), nc.compute_ngram_ids(layout, *batch))
    context = nc.advance_context(layout, *on_device(*batch))
    np.testing.assert_array_equal(context.get(), nc.advance_context(layout, *batch))


@pytest.mark.gpu
@pytest.mark.parametrize("padding", [1, 200, 5000])
def test_gpu_padded_batches_equal_cpu(padding):
    """A batch padded to a graph size (SPEC 10.3), padding spanning whole blocks: the CPU's ids
    (vLLM's), the fused forward's rows too; the roll ignores the padding."""
    import ml_dtypes

    layout = GPU_LAYOUTS[2]  # a small table
    tokens, starts, context = random_typed_batch(layout, 300, 5, np.int64, seed=padding)
    padded = np.concatenate([tokens, np.zeros(padding, np.int64)])
    want = nc.compute_ngram_ids(layout, padded, starts, context)
    np.testing.assert_array_equal(nc.compute_ngram_ids(layout, *on_device(padded, starts,
                                                                          context)).get(), want)
    rolled = nc.advance_context(layout, *on_device(padded, starts, context))
    np.testing.assert_array_equal(rolled.get(), nc.advance_context(layout, tokens, starts, context))
    rows = np.random.default_rng(1).standard_normal((layout.padded_rows, 4))
    table = nc.EmbeddingTable(rows.astype(ml_dtypes.bfloat16), placement="gpu")
    fused = nc.NGramEmbedding(layout, table, fused=True)(*on_device(padded, starts, context))
    np.testing.assert_array_equal(fused.get(), nc.EmbeddingTable(
        rows.astype(ml_dtypes.bfloat16)).lookup(want).view(np.uint16))


@pytest.mark.gpu
def test_gpu_matches_reference_on_golden(golden):
    layout, _, batches = golden
    for batch in batches:
        arrays = on_device(batch["input_ids"], batch["query_start_loc"], batch["ngram_context"])
        np.testing.assert_array_equal(nc.compute_ngram_ids(layout, *arrays).get(),
                                      batch["ngram_ids"])


@pytest.mark.gpu
def test_gpu_out_reused_and_context_rolled_in_place():
    import cupy

    layout = GPU_LAYOUTS[0]
    out = cupy.full((300, layout.num_heads), -1, dtype=np.int64)
    for seed in range(3):
        tokens, starts, context = random_typed_batch(layout, 300, 5, seed=seed)
        device = on_device(tokens, starts, context)
        assert nc.compute_ngram_ids(layout, *device, out=out) is out
        np.testing.assert_array_equal(out.get(), nc.compute_ngram_ids(layout, tokens, starts,
                                                                      context))
        state = device[2]
        nc.advance_context(layout, *device, out=state[:5])
        np.testing.assert_array_equal(state.get()[:5], reference.advance_context(
            layout, tokens, starts, context))


@pytest.mark.gpu
def test_gpu_non_contiguous_inputs_and_a_cupy_stream():
    import cupy

    layout = GPU_LAYOUTS[2]
    tokens, starts, context = random_typed_batch(layout, 1000, 9)
    stream = cupy.cuda.Stream(non_blocking=True)
    spread = cupy.zeros(2000, dtype=tokens.dtype)
    spread[::2] = cupy.asarray(tokens)
    device = on_device(starts, context)
    cupy.cuda.Stream.null.synchronize()  # a non-blocking stream does not wait for the null one
    ids = nc.compute_ngram_ids(layout, spread[::2], *device, stream=stream)
    stream.synchronize()
    np.testing.assert_array_equal(ids.get(), nc.compute_ngram_ids(layout, tokens, starts, context))


@pytest.mark.gpu
def test_gpu_garbage_query_start_loc_stays_in_bounds():
    import cupy

    layout = GPU_LAYOUTS[0]
    tokens, _, context = random_typed_batch(layout, 5000, 4)
    big = np.iinfo(np.int64)
    for starts in ([0, big.max, big.min, 5000, -7], [9, 4, 30, 2, 1], [0, 0, 0, 0, 0]):
        ids = nc.compute_ngram_ids(layout, *on_device(tokens, np.array(starts), context))
        rolled = nc.advance_context(layout, *on_device(tokens, np.array(starts), context))
        cupy.cuda.runtime.deviceSynchronize()  # an out-of-bounds access would fail here
        ids = ids.get()
        assert np.all(ids >= layout.head_offsets)
        assert np.all(ids < layout.head_offsets + layout.head_sizes)
        assert rolled.shape == (4, 2)


def _torch_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA build of PyTorch")
    return torch


@pytest.mark.gpu
def test_torch_cuda_tensors_on_a_torch_stream_and_dlpack_out():
    torch = _torch_cuda()
    layout = GPU_LAYOUTS[0]
    tokens, starts, context = random_typed_batch(layout, 4096, 16)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        tensors = [torch.from_numpy(a).cuda() for a in (tokens, starts, context)]
        ids = nc.compute_ngram_ids(layout, *tensors, stream=stream)
        as_torch = torch.from_dlpack(ids)
        rolled = torch.from_dlpack(nc.advance_context(layout, *tensors, stream=stream))
    # torch in, torch out: ``ids`` is a tensor (``.data`` is a tensor too, without ``.ptr``)
    assert isinstance(ids, torch.Tensor) and ids.device.type == "cuda"
    assert as_torch.data_ptr() == ids.data_ptr()
    stream.synchronize()
    np.testing.assert_array_equal(as_torch.cpu().numpy(),
                                  nc.compute_ngram_ids(layout, tokens, starts, context))
    np.testing.assert_array_equal(rolled.cpu().numpy(),
                                  nc.advance_context(layout, tokens, starts, context))


@pytest.mark.gpu
def test_torch_cuda_out_is_written_in_place():
    torch = _torch_cuda()
    layout = GPU_LAYOUTS[0]
    tokens, starts, context = random_typed_batch(layout, 256, 256)
    out = torch.full((256, layout.num_heads), -1, dtype=torch.int64, device="cuda")
    ids = nc.compute_ngram_ids(layout, *(torch.from_numpy(a).cuda() for a in (tokens, starts,
                                                                           context)), out=out)
    assert ids is out and ids.data_ptr() == out.data_ptr()
    torch.cuda.synchronize()
    np.testing.assert_array_equal(out.cpu().numpy(),
                                  nc.compute_ngram_ids(layout, tokens, starts, context))


@pytest.mark.gpu
def test_cuda_graph_capture_replays_compute_and_roll():
    import cupy

    layout = GPU_LAYOUTS[0]
    first = random_typed_batch(layout, 256, 256, seed=1)
    second = random_typed_batch(layout, 256, 256, seed=2)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        tokens, starts, context = on_device(*first)
        ids = cupy.empty((256, layout.num_heads), dtype=np.int64)
        rolled = cupy.empty_like(context[:256])
        nc.compute_ngram_ids(layout, tokens, starts, context, out=ids)  # compile, upload: warm up
        nc.advance_context(layout, tokens, starts, context, out=rolled)
        stream.synchronize()
        stream.begin_capture()
        nc.compute_ngram_ids(layout, tokens, starts, context, out=ids)
        nc.advance_context(layout, tokens, starts, context, out=rolled)
        graph = stream.end_capture()
        for batch in (second, first):
            for device_array, host_array in zip((tokens, starts, context), batch, strict=True):
                device_array.set(host_array, stream=stream)
            ids.fill(-1)
            graph.launch(stream=stream)
            stream.synchronize()
            np.testing.assert_array_equal(ids.get(), nc.compute_ngram_ids(layout, *batch))
            np.testing.assert_array_equal(rolled.get(), nc.advance_context(layout, *batch))
