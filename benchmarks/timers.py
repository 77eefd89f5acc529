"""Timers: median seconds per call on the host, interleaved pairs, and CUDA event timing."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np


def calls_lasting(fn: Callable[[], object], seconds: float, max_calls: int = 100_000) -> int:
    """How many back-to-back calls of ``fn`` take at least ``seconds`` (a power of 4)."""
    calls = 1
    while calls < max_calls:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        if time.perf_counter() - start >= seconds:
            break
        calls *= 4
    return calls


def per_call(fn: Callable[[], object], calls: int) -> float:
    """Seconds per call of ``calls`` back-to-back calls."""
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def timeit(fn: Callable[[], object], min_time: float = 0.3, max_calls: int = 100_000) -> float:
    """Median seconds per call of ``fn`` over 5 batches of calls lasting ``min_time`` in all."""
    fn()  # warm-up: compilation, first-touch page faults
    calls = calls_lasting(fn, min_time / 5, max_calls)
    return float(np.median([per_call(fn, calls) for _ in range(5)]))


def paired(first: Callable[[], object], second: Callable[[], object],
           min_time: float = 2.0, rounds: int = 21) -> tuple[float, float, float]:
    """Median seconds per call of two functions timed in alternating batches, and the median of
    the rounds' ratios ``first / second``.

    Alternating makes both see the same load: a noisy neighbour slows both, not one. The ratio of
    each round's pair follows a load that changes between rounds, which the two medians do not.
    """
    first()
    second()
    calls = calls_lasting(second, min_time / (2 * rounds))
    a, b = [], []
    deadline = time.perf_counter() + min_time
    while len(a) < rounds or time.perf_counter() < deadline:
        a.append(per_call(first, calls))
        b.append(per_call(second, calls))
    ratios = np.array(a) / np.array(b)
    return float(np.median(a)), float(np.median(b)), float(np.median(ratios))


def copy_floor(nbytes: int) -> float:
    """Seconds to copy ``nbytes`` once between two preallocated host arrays: the memory floor."""
    source = np.ones(nbytes // 8, dtype=np.int64)
    target = np.empty_like(source)
    return timeit(lambda: np.copyto(target, source))


def gpu_timeit(fn: Callable[[], object], min_time: float = 0.2) -> float:
    """Median seconds per call of ``fn``, by CUDA events around batches of calls on the current
    stream: the GPU time when the GPU is busier than the host, else the host's launch rate."""
    import cupy

    stream = cupy.cuda.get_current_stream()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()

    def batch(calls: int) -> float:
        start.record(stream)
        for _ in range(calls):
            fn()
        end.record(stream)
        end.synchronize()
        return cupy.cuda.get_elapsed_time(start, end) / 1e3

    batch(1)  # warm-up: compilation, the layer's constants
    calls = 1
    while batch(calls) < min_time / 5 and calls < 100_000:
        calls *= 4
    return float(np.median([batch(calls) / calls for _ in range(5)]))


def graph_seconds(fn: Callable[[], object], calls: int = 20) -> float:
    """GPU seconds per call of ``fn`` alone: ``calls`` calls captured in a CUDA graph, replayed."""
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        fn()  # warm-up outside the capture: compilation, the layer's constants
        stream.synchronize()
        stream.begin_capture()
        try:
            for _ in range(calls):
                fn()
        finally:  # a failed capture must still end, or the stream stays in capture mode
            graph = stream.end_capture()
        return gpu_timeit(graph.launch) / calls


def device_copy_seconds(nbytes: int) -> float:
    """Seconds to copy ``nbytes`` between two device buffers (cudaMemcpyAsync), by CUDA events."""
    import cupy

    source = cupy.ones(nbytes // 8, dtype=np.int64)
    target = cupy.empty_like(source)
    return gpu_timeit(lambda: target.data.copy_from_device_async(source.data, nbytes))
