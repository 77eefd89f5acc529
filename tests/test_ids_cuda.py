"""The GPU ids and context kernels: simulator runs and PTX on the CPU; bit-exact runs on a GPU."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from numba import cuda, types

import ngram_cupy as nc
from ngram_cupy import ids_cuda, reference

SIM_CHECK = Path(__file__).with_name("cuda_sim_check.py")
DIVISION_64 = re.compile(r"\b(?:div|rem)\.[us]64\b")


@pytest.fixture(scope="module")
def simulator_results():
    """Every check of cuda_sim_check.py, run once in a subprocess under the CUDA simulator."""
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}
    run = subprocess.run([sys.executable, str(SIM_CHECK)], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_kernels_in_the_simulator_match_the_cpu_path(simulator_results):
    assert len(simulator_results) >= 9
    failed = {name: error for name, error in simulator_results.items() if error != "ok"}
    assert not failed, "\n".join(f"{name}:\n{error}" for name, error in failed.items())


class _Device:
    compute_capability = (9, 0)


@pytest.fixture
def ptx(monkeypatch):
    """``compile_ptx`` without a GPU: Numba asks the driver for a device when a kernel calls a
    helper function, so answer for it."""
    monkeypatch.setattr(cuda.dispatcher, "get_current_device", lambda: _Device)

    def compile_ptx(kernel, signature, cc):
        return cuda.compile_ptx(kernel.py_func, signature, cc=cc)[0]

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


def random_batch(layout, num_tokens, num_requests, dtype=np.int64, seed=0):
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

    batch = random_batch(layout, num_tokens, num_requests, dtype, seed=num_tokens)
    ids = nc.compute_ngram_ids(layout, *on_device(*batch))
    assert isinstance(ids, cupy.ndarray) and ids.dtype == np.int64
    np.testing.assert_array_equal(ids.get(), nc.compute_ngram_ids(layout, *batch))
    context = nc.advance_context(layout, *on_device(*batch))
    np.testing.assert_array_equal(context.get(), nc.advance_context(layout, *batch))


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
        tokens, starts, context = random_batch(layout, 300, 5, seed=seed)
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
    tokens, starts, context = random_batch(layout, 1000, 9)
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
    tokens, _, context = random_batch(layout, 5000, 4)
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
    tokens, starts, context = random_batch(layout, 4096, 16)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        tensors = [torch.from_numpy(a).cuda() for a in (tokens, starts, context)]
        ids = nc.compute_ngram_ids(layout, *tensors, stream=stream)
        as_torch = torch.from_dlpack(ids)
        rolled = torch.from_dlpack(nc.advance_context(layout, *tensors, stream=stream))
    assert as_torch.data_ptr() == ids.data.ptr and as_torch.device.type == "cuda"
    stream.synchronize()
    np.testing.assert_array_equal(as_torch.cpu().numpy(),
                                  nc.compute_ngram_ids(layout, tokens, starts, context))
    np.testing.assert_array_equal(rolled.cpu().numpy(),
                                  nc.advance_context(layout, tokens, starts, context))


@pytest.mark.gpu
def test_torch_cuda_out_is_written_in_place():
    torch = _torch_cuda()
    layout = GPU_LAYOUTS[0]
    tokens, starts, context = random_batch(layout, 256, 256)
    out = torch.full((256, layout.num_heads), -1, dtype=torch.int64, device="cuda")
    ids = nc.compute_ngram_ids(layout, *(torch.from_numpy(a).cuda() for a in (tokens, starts,
                                                                           context)), out=out)
    assert ids.data.ptr == out.data_ptr()
    torch.cuda.synchronize()
    np.testing.assert_array_equal(out.cpu().numpy(),
                                  nc.compute_ngram_ids(layout, tokens, starts, context))


@pytest.mark.gpu
def test_cuda_graph_capture_replays_compute_and_roll():
    import cupy

    layout = GPU_LAYOUTS[0]
    first = random_batch(layout, 256, 256, seed=1)
    second = random_batch(layout, 256, 256, seed=2)
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
