"""The Numba CUDA kernels in the CUDA simulator, against the CPU path and the reference.

Run by tests/test_ids_cuda.py as ``NUMBA_ENABLE_CUDASIM=1 python tests/cuda_sim_check.py``; the
last line printed is a JSON object ``{check: "ok" or the error}``. Every index the simulated
kernels apply to an argument array is bounds-checked, negative ones included (NumPy would wrap
them silently), so an out-of-bounds read or write fails its check. Inputs stay tiny: the
simulator runs each GPU thread as a Python thread.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
import types

import numpy as np

if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
    sys.exit("run with NUMBA_ENABLE_CUDASIM=1")

from conftest import GOLDEN_FILES, load_golden  # noqa: E402  (tests/ is this script's directory)
from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray  # noqa: E402

import ngram_cupy as nc  # noqa: E402
from ngram_cupy import ids_cuda, reference  # noqa: E402
from ngram_cupy.cuda_launch import NumbaKernel  # noqa: E402


def _checked(method):
    """A FakeCUDAArray accessor that refuses any integer index outside its axis."""

    def access(self, index, *value):
        for axis, i in enumerate(index if isinstance(index, tuple) else (index,)):
            if isinstance(i, int | np.integer) and not 0 <= i < self._ary.shape[axis]:
                raise IndexError(f"index {i} outside axis {axis} of shape {self._ary.shape}")
        return method(self, index, *value)

    return access


FakeCUDAArray.__getitem__ = _checked(FakeCUDAArray.__getitem__)
FakeCUDAArray.__setitem__ = _checked(FakeCUDAArray.__setitem__)


def gpu_ids(layout, tokens, starts, context, block):
    """Ids from the simulated kernel; arrays are passed as device arrays, so no copies."""
    out = np.full((len(tokens), layout.num_heads), -1, dtype=np.int64)
    ids_cuda.launch_ngram_ids(layout, FakeCUDAArray(tokens), FakeCUDAArray(starts),
                              FakeCUDAArray(context), FakeCUDAArray(ids_cuda.layout_params(layout)),
                              FakeCUDAArray(out), block=block)
    return out


def gpu_advance(tokens, starts, context, out):
    """Rolled contexts from the simulated kernel, written into ``out`` (which may alias)."""
    ids_cuda.launch_advance_context(FakeCUDAArray(tokens), FakeCUDAArray(starts),
                                    FakeCUDAArray(context), FakeCUDAArray(out))
    return out


def random_batch(rng, layout, num_tokens, num_requests, dtypes=(np.int64,) * 3, spare_rows=1):
    """Tokens mixing valid ids, EOS and arbitrary int64 values; cuts with empty requests."""
    vocab, eos = layout.config.vocab_size, layout.eos_token_id

    def draw(shape, dtype):
        values = rng.integers(0, vocab, shape)
        pick = rng.random(shape)
        values[pick < 0.3] = eos
        wild = pick > 0.85
        values[wild] = rng.integers(np.iinfo(dtype).min, np.iinfo(dtype).max, wild.sum(),
                                    dtype=dtype, endpoint=True)
        return values.astype(dtype)

    cuts = np.sort(rng.integers(0, num_tokens + 1, num_requests - 1))
    starts = np.concatenate([[0], cuts, [num_tokens]]).astype(dtypes[1])
    width = layout.ngram_size - 1
    return (draw(num_tokens, dtypes[0]), starts,
            draw((num_requests + spare_rows, width), dtypes[2]))


def layouts():
    """Small layouts covering bigrams to 5-grams, odd and even head counts, tiny head sizes."""
    configs = [nc.NGramConfig(50, 2, 1, 3, 0), nc.NGramConfig(300, 3, 2, 40, 7),
               nc.NGramConfig(1000, 4, 3, 500, 999), nc.NGramConfig(97, 5, 1, 2, 5)]
    return [nc.layer_layout(config, layer) for layer, config in enumerate(configs)]


def assert_ids(layout, tokens, starts, context, block):
    expected = reference.compute_ngram_ids(layout, tokens, starts, context)
    np.testing.assert_array_equal(nc.compute_ngram_ids(layout, tokens, starts, context), expected)
    np.testing.assert_array_equal(gpu_ids(layout, tokens, starts, context, block), expected)


CHECKS = {}


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


@check
def golden_vectors():
    for path in GOLDEN_FILES:
        layout, _, batches = load_golden(path)
        for batch in batches:
            ids = gpu_ids(layout, batch["input_ids"], batch["query_start_loc"],
                          batch["ngram_context"], block=32)
            np.testing.assert_array_equal(ids, batch["ngram_ids"], err_msg=path.name)


@check
def random_batches_match_cpu_path():
    """EOS-heavy, out-of-range and negative tokens; several blocks, a partial last block."""
    rng = np.random.default_rng(3)
    for layout in layouts():
        for num_tokens, num_requests, block in [(11, 3, 4), (9, 1, 8), (16, 5, 4)]:
            assert_ids(layout, *random_batch(rng, layout, num_tokens, num_requests), block)


@check
def empty_requests_and_batches():
    layout = layouts()[1]
    tokens = np.arange(7, dtype=np.int64)
    context = np.full((6, 2), 5, dtype=np.int64)
    for starts in ([0, 0, 3, 3, 7, 7], [0, 7], [0, 0, 0, 0, 0, 7]):
        assert_ids(layout, tokens, np.array(starts), context, block=4)
    empty = gpu_ids(layout, tokens[:0], np.zeros(3, np.int64), context, block=4)
    assert empty.shape == (0, layout.num_heads)


@check
def int32_inputs():
    rng = np.random.default_rng(5)
    layout = layouts()[2]
    for dtypes in [(np.int32,) * 3, (np.int32, np.int64, np.int32), (np.int64, np.int32, np.int64)]:
        assert_ids(layout, *random_batch(rng, layout, 10, 3, dtypes, spare_rows=0), block=4)


@check
def released_config_decode():
    config = nc.NGramConfig(vocab_size=248320, ngram_size=3, heads_per_ngram=8,
                            ngram_vocab_size_base=20_000_000, eos_token_id=248044)
    layout = nc.layer_layout(config, 0)
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, config.vocab_size, 6)
    tokens[2] = config.eos_token_id
    context = rng.integers(0, config.vocab_size, (8, 2))  # a persistent buffer: spare rows
    assert_ids(layout, tokens, np.arange(7), context, block=4)


@check
def garbage_query_start_loc_stays_in_bounds():
    """Any values: no access outside the arrays, every id inside its head's rows."""
    rng = np.random.default_rng(11)
    layout = layouts()[1]
    low = layout.head_offsets
    high = layout.head_offsets + layout.head_sizes
    big = np.iinfo(np.int64)
    garbage = [[5], [-3, 2], [big.max, big.min, 0], [9, 4, 30, 2, -1], [0, 2, 1, 100]]
    garbage += [rng.integers(-20, 20, 6) for _ in range(3)]
    for starts in garbage:
        starts = np.array(starts, dtype=np.int64)
        num_requests = len(starts) - 1
        tokens, _, context = random_batch(rng, layout, 7, max(num_requests, 1), spare_rows=0)
        context = context[:num_requests]
        if num_requests:  # R = 0 with tokens is refused from shapes alone, before any launch
            ids = gpu_ids(layout, tokens, starts, context, block=4)
            assert np.all((ids >= low) & (ids < high)), starts
        out = np.zeros((num_requests, 2), dtype=np.int64)
        gpu_advance(tokens, starts, context, out)
        gpu_advance(tokens[:0], starts, context, out)


@check
def advance_context_matches_reference():
    rng = np.random.default_rng(13)
    for layout in layouts():
        for num_tokens, num_requests in [(0, 2), (1, 1), (9, 4)]:
            tokens, starts, context = random_batch(rng, layout, num_tokens, num_requests)
            expected = reference.advance_context(layout, tokens, starts, context)
            out = np.zeros_like(context[:num_requests])
            np.testing.assert_array_equal(gpu_advance(tokens, starts, context, out), expected)
            gpu_advance(tokens, starts, context, context[:num_requests])  # in place
            np.testing.assert_array_equal(context[:num_requests], expected)


@check
def chunked_decode_equals_whole():
    """Decode one token per step with contexts rolled on the device equals one prefill."""
    layout = layouts()[2]
    rng = np.random.default_rng(17)
    tokens, _, context = random_batch(rng, layout, 8, 1, spare_rows=0)
    whole = reference.compute_ngram_ids(layout, tokens, [0, 8], context)
    state = context.copy()
    for t in range(8):
        one = tokens[t : t + 1]
        np.testing.assert_array_equal(gpu_ids(layout, one, np.array([0, 1]), state, block=4),
                                      whole[t : t + 1])
        gpu_advance(one, np.array([0, 1]), state, state)


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
    cupy = types.ModuleType("cupy")
    cupy.ndarray = StandInArray
    cupy.cuda = types.SimpleNamespace(Stream=StandInContext, ExternalStream=StandInContext,
                                      get_current_stream=StandInContext)
    cupy.ascontiguousarray = lambda a: StandInArray(np.ascontiguousarray(a.host))
    cupy.empty = lambda shape, dtype: StandInArray(np.full(shape, -1, dtype=dtype))
    return cupy


@check
def public_functions_take_the_device_path():
    """compute_ngram_ids/advance_context on (stand-in) device arrays: dispatch, out=, errors."""
    sys.modules["cupy"] = stand_in_cupy()
    launch = NumbaKernel.__call__  # run the simulator on the stand-ins' memory

    def simulated(self, grid, block, args, stream=None):
        args = tuple(FakeCUDAArray(a.host) if isinstance(a, StandInArray) else a for a in args)
        return launch(self, grid, block, args, stream)

    NumbaKernel.__call__ = simulated
    ids_cuda.device_params = lambda layout, device: FakeCUDAArray(ids_cuda.layout_params(layout))
    rng = np.random.default_rng(19)
    layout = layouts()[1]
    tokens, starts, context = random_batch(rng, layout, 9, 3)
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
    try:
        nc.compute_ngram_ids(layout, device[0], StandInArray(np.zeros(1, np.int64)), device[2])
    except ValueError as error:
        assert "query_start_loc holds no request" in str(error)
    else:
        raise AssertionError("R = 0 with tokens was not refused")


def main() -> int:
    results = {}
    for name, fn in CHECKS.items():
        try:
            fn()
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
