"""The XLA FFI bridge under ngram_cupy.jax: buffers handed over in place, exceptions carried
back, one compiled call per bound function (skipped without jax)."""

from __future__ import annotations

import gc

import ml_dtypes
import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

from ngram_cupy.jax import ffi as jax_ffi  # noqa: E402


class Owner:
    """Something a custom call is bound to (a table, a layout, an optimizer)."""

    def __init__(self):
        self.seen: list[tuple[int, int]] = []


def record_and_double(owner, extra, inputs, outputs, stream):
    """Note where the buffers are, then write twice the input into the output."""
    owner.seen.append((inputs[0].ctypes.data, outputs[0].ctypes.data))
    np.multiply(inputs[0], extra[0], out=outputs[0])


def copy(owner, extra, inputs, outputs, stream):
    np.copyto(outputs[0], inputs[0])


def fail(owner, extra, inputs, outputs, stream):
    raise IndexError("row 7 is not here")


def spec(array):
    return [jax.ShapeDtypeStruct(array.shape, array.dtype)]


def test_buffers_are_handed_over_in_place_eagerly_and_jitted():
    owner = Owner()
    x = jnp.arange(4096, dtype=jnp.float32) + 1  # a buffer of XLA's own
    (eager,) = jax_ffi.custom_call(owner, record_and_double, (2,), spec(x), x)
    assert owner.seen[-1] == (x.unsafe_buffer_pointer(), eager.unsafe_buffer_pointer())
    jitted = jax.jit(lambda v: jax_ffi.custom_call(owner, record_and_double, (2,), spec(v), v)[0])
    result = jitted(x)
    assert owner.seen[-1] == (x.unsafe_buffer_pointer(), result.unsafe_buffer_pointer())
    np.testing.assert_array_equal(np.asarray(result), 2 * np.asarray(x))
    np.testing.assert_array_equal(np.asarray(eager), 2 * np.asarray(x))


def test_bfloat16_and_bool_buffers_keep_their_types():
    owner = Owner()
    for value in (jnp.ones((3, 5), jnp.bfloat16), jnp.array([True, False])):
        (out,) = jax_ffi.custom_call(owner, copy, (), spec(value), value)
        assert out.dtype == value.dtype
        np.testing.assert_array_equal(np.asarray(out), np.asarray(value))
    assert np.dtype(ml_dtypes.bfloat16) == jnp.ones(1, jnp.bfloat16).dtype


def test_a_raised_exception_comes_back_eagerly_and_as_xla_error_under_jit():
    owner, x = Owner(), jnp.zeros(3)
    with pytest.raises(IndexError, match="row 7 is not here"):
        jax_ffi.custom_call(owner, fail, (), spec(x), x)
    jitted = jax.jit(lambda v: jax_ffi.custom_call(owner, fail, (), spec(v), v)[0])
    with pytest.raises(jax.errors.JaxRuntimeError, match="IndexError: row 7 is not here"):
        jitted(x).block_until_ready()


def doubling(owner: Owner):
    """A jitted function doubling its argument through a custom call bound to ``owner``."""
    return jax.jit(lambda v: jax_ffi.custom_call(owner, record_and_double, (2,), spec(v), v)[0])


def test_a_call_is_compiled_once_per_owner_and_dropped_with_it():
    owner, x = Owner(), jnp.ones(8)
    jitted = doubling(owner)
    for _ in range(3):
        jitted(x)
    assert jitted._cache_size() == 1 and len(owner.seen) == 3
    assert sum(call.owner() is owner for call in jax_ffi.bound_calls()) == 1
    gc.collect()  # owners that earlier tests left in reference cycles go first
    bound = len(jax_ffi.bound_calls())
    del owner, jitted
    gc.collect()
    assert len(jax_ffi.bound_calls()) == bound - 1


def test_a_call_whose_owner_is_gone_says_so():
    x = jnp.ones(8)
    compiled = doubling(Owner()).lower(x).compile()  # the owner lives in the dropped closure
    gc.collect()
    with pytest.raises(jax.errors.JaxRuntimeError, match="traced with is gone"):
        compiled(x).block_until_ready()


def test_vmap_runs_the_call_once_per_element():
    owner = Owner()
    x = jnp.arange(12.0).reshape(3, 4)
    double = jax.vmap(lambda v: jax_ffi.custom_call(owner, record_and_double, (2,), spec(v),
                                                    v)[0])
    np.testing.assert_array_equal(np.asarray(double(x)), 2 * np.asarray(x))


def test_a_large_result_is_written_whole():
    """Results of 4 MiB and more are advised huge pages first; the values are the same."""
    owner = Owner()
    x = jnp.arange(3 << 20, dtype=jnp.float32)  # 12 MiB
    (out,) = jax_ffi.custom_call(owner, copy, (), spec(x), x)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x))


class FakeCuda:
    """The corner of CuPy the device views use: memory wrappers, arrays, external streams."""

    def __init__(self):
        cuda = self
        self.runtime = type("runtime", (), {"getDevice": staticmethod(lambda: 0)})

        class UnownedMemory:
            def __init__(self, ptr, size, owner):
                self.ptr, self.size = ptr, size

        class MemoryPointer:
            def __init__(self, memory, offset):
                self.memory = memory

        class ExternalStream:
            def __init__(self, handle, device):
                self.handle, self.device = handle, device

        self.UnownedMemory, self.MemoryPointer, self.ExternalStream = (
            UnownedMemory, MemoryPointer, ExternalStream)
        self.made = []

        class ndarray:  # noqa: N801  CuPy's name
            def __init__(self, shape, dtype, pointer):
                self.shape, self.dtype, self.ptr = shape, dtype, pointer.memory.ptr
                self.device = type("device", (), {"id": 3})
                cuda.made.append(self)

        self.ndarray = ndarray


def test_the_cuda_handler_views_device_buffers_on_xlas_stream(monkeypatch):
    """The device branch, driven by a call frame built here: CuPy views of the buffers (bfloat16
    as uint16), XLA's stream from its API on the buffers' device, the key's function run."""
    import ctypes
    import types

    fake = FakeCuda()
    monkeypatch.setitem(__import__("sys").modules, "cupy",
                        types.SimpleNamespace(cuda=fake, ndarray=fake.ndarray))
    dims = (ctypes.c_int64 * 2)(4, 8)
    arg = jax_ffi.Buffer(ctypes.sizeof(jax_ffi.Buffer), None, 4, 0x1000, 2, dims)  # int32
    ret = jax_ffi.Buffer(ctypes.sizeof(jax_ffi.Buffer), None, 16, 0x2000, 2, dims)  # bf16
    args = (ctypes.POINTER(jax_ffi.Buffer) * 1)(ctypes.pointer(arg))
    rets = (ctypes.POINTER(jax_ffi.Buffer) * 1)(ctypes.pointer(ret))
    seen = []
    owner = Owner()
    key = jax_ffi.function_key(
        owner, lambda o, extra, i, out, stream: seen.append((i, out, stream)), ())
    value = ctypes.c_int64(key)
    scalar = jax_ffi.Scalar(5, ctypes.pointer(value))
    attrs = (ctypes.POINTER(jax_ffi.Scalar) * 1)(ctypes.pointer(scalar))

    @jax_ffi.StreamGet
    def stream_get(stream_args):
        stream_args.contents.stream = 0xABC
        return None

    api = jax_ffi.Api(stream_get=stream_get)
    frame = jax_ffi.CallFrame(
        ctypes.sizeof(jax_ffi.CallFrame), None, ctypes.pointer(api), None, 3,
        jax_ffi.Items(0, None, 1, None, args), jax_ffi.Items(0, None, 1, None, rets),
        jax_ffi.Attrs(0, None, 1, None, None, attrs), None)
    assert jax_ffi.handle(ctypes.pointer(frame), True) is None
    ((inputs, outputs, stream),) = seen
    assert [(a.ptr, a.shape, a.dtype) for a in inputs + outputs] == [
        (0x1000, (4, 8), np.int32), (0x2000, (4, 8), np.uint16)]
    assert (stream.handle, stream.device) == (0xABC, 3)
