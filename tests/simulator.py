"""The Numba CUDA simulator in the test process, with checked arrays.

``simulate`` (a fixture, see conftest.py) makes every ``NumbaKernel`` launch run its very Python
kernel in Numba's CUDA simulator (one Python thread per GPU thread) instead of on a GPU, with no
environment variable and no subprocess. Every index a simulated kernel applies to an argument
array is bounds-checked, negative ones included (NumPy would wrap them silently), and every
element access must be aligned to the element size, as a GPU load or store must be: an array
whose data starts off its element alignment fails (a misaligned-address fault on hardware). A
strided argument fails too: the compiled kernel would index it as C-contiguous.
Inputs stay tiny: the simulator costs about a millisecond per thread.
"""

from __future__ import annotations

import numpy as np
from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
from numba.cuda.simulator.kernel import FakeCUDAKernel

import ngram_cupy as nc
from ngram_cupy.runtime.cuda_launch import NumbaKernel


class MisalignedAccess(IndexError):
    """A simulated kernel read or wrote an element at an address not aligned to its size."""


def checked(method):
    """A FakeCUDAArray accessor refusing indices outside an axis and misaligned elements."""

    def access(self, index, *value):
        array = self._ary
        for axis, i in enumerate(index if isinstance(index, tuple) else (index,)):
            if isinstance(i, int | np.integer) and not 0 <= i < array.shape[axis]:
                raise IndexError(f"index {i} outside axis {axis} of shape {array.shape}")
        if array.ctypes.data % array.itemsize or any(s % array.itemsize for s in array.strides):
            raise MisalignedAccess(f"{array.dtype} elements at {array.ctypes.data:#x}: not "
                                   f"{array.itemsize}-byte aligned")
        return method(self, index, *value)

    return access


class NotContiguous(ValueError):
    """A kernel was passed a strided array: compiled kernels index arrays as C-contiguous (by
    shape, not strides), so on a GPU it would read the wrong bytes."""


def device(value):
    """NumPy arrays as simulator device arrays (no copy, so aliasing stays); others unchanged.
    A strided array is refused, as ``numba_type`` compiles every array as C-contiguous."""
    if not (isinstance(value, np.ndarray) and value.ndim):
        return value
    if not value.flags.c_contiguous:
        raise NotContiguous(f"a kernel argument of shape {value.shape} has strides "
                            f"{value.strides}: not C-contiguous")
    return FakeCUDAArray(value)


def simulated_launch(kernel: NumbaKernel, grid: int, block: int, args: tuple,
                     stream=None) -> None:
    """``NumbaKernel.__call__`` in the simulator: the same Python kernel, the same arguments."""
    FakeCUDAKernel(kernel.py_func, device=False)[grid, block](*map(device, args))


def install(monkeypatch) -> None:
    """Route every ``NumbaKernel`` launch to the simulator, with checked arrays (undone by
    ``monkeypatch``)."""
    monkeypatch.setattr(NumbaKernel, "__call__", simulated_launch)
    monkeypatch.setattr(FakeCUDAArray, "__getitem__", checked(FakeCUDAArray.__getitem__))
    monkeypatch.setattr(FakeCUDAArray, "__setitem__", checked(FakeCUDAArray.__setitem__))


def wild_batch(rng, layout, num_tokens, num_requests, dtypes=(np.int64,) * 3, spare_rows=1):
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
    """Small layouts covering bigrams to 5-grams, odd and even head counts, tiny head sizes.

    Their (n, heads per n-gram) are test_ngram_ids' SHAPES: the CPU ids the simulated kernels
    are compared with then need no Numba compile of their own."""
    configs = [nc.NGramConfig(50, 2, 1, 3, 0), nc.NGramConfig(300, 3, 2, 40, 7),
               nc.NGramConfig(1000, 4, 4, 500, 999), nc.NGramConfig(97, 5, 3, 2, 5)]
    return [nc.layer_layout(config, layer) for layer, config in enumerate(configs)]
