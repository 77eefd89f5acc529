"""Python functions as XLA FFI custom calls (``jax.ffi``), for ``ngram_cupy.jax``'s functions.

One handler, a ctypes function registered once per platform as the FFI target ``TARGET``,
reads XLA's call frame (``xla/ffi/api/c_api.h``, which ships in ``jax.ffi.include_dir()``),
views every argument and result buffer in place, as NumPy arrays on the CPU and CuPy arrays on a
CUDA device, and runs the Python function named by the call's ``key`` attribute on them, with
XLA's CUDA stream on a GPU; the key is a handle (``runtime/handles.py``) of the function bound
to the object it was traced with. No buffer is copied: results are written into the buffers XLA
allocated. A Python exception becomes an XLA error carrying its type and message; eager callers
get the exception itself back (``custom_call``).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import jax
import ml_dtypes
import numpy as np

from ..runtime import handles

TARGET = "ngram_cupy_python"
_API_VERSION = (0, 3)  # the XLA FFI C API this handler speaks (XLA_FFI_API_MAJOR / MINOR)
_EXECUTE = 3  # XLA_FFI_ExecutionStage_EXECUTE
_METADATA = 1  # XLA_FFI_Extension_Metadata: XLA asks the handler's API version once
_UNKNOWN = 2  # XLA_FFI_Error_Code_UNKNOWN
# XLA_FFI_DataType codes -> the NumPy dtype a buffer is viewed as (bfloat16 as raw bits on CUDA).
_DTYPES = {1: np.bool_, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.uint8,
           7: np.uint16, 8: np.uint32, 9: np.uint64, 10: np.float16, 11: np.float32,
           12: np.float64, 16: ml_dtypes.bfloat16}
_c_int64_p = ctypes.POINTER(ctypes.c_int64)
# Results of at least this many bytes are advised MADV_HUGEPAGE before they are written, as
# NumPy advises its own large arrays: XLA allocates each call's result afresh, and faulting it in
# 4 KiB pages took a 42 MB lookup 3x as long as the gather itself.
_HUGE_RESULT = 4 << 20
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
_LIBC = ctypes.CDLL(None)
_LIBC.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


class Extension(ctypes.Structure):
    """XLA_FFI_Extension_Base: the head of an extension in a call frame's list."""

    _fields_ = [("struct_size", ctypes.c_size_t), ("type", ctypes.c_int),
                ("next", ctypes.c_void_p)]


class ApiVersion(ctypes.Structure):
    """XLA_FFI_Api_Version: the C API version a handler speaks."""

    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("major", ctypes.c_int), ("minor", ctypes.c_int)]


class Metadata(ctypes.Structure):
    """XLA_FFI_Metadata: what a handler tells XLA about itself when asked."""

    _fields_ = [("struct_size", ctypes.c_size_t), ("api_version", ApiVersion),
                ("traits", ctypes.c_uint32), ("state_type_id", ctypes.c_int64)]


class MetadataExtension(ctypes.Structure):
    """XLA_FFI_Metadata_Extension: XLA's question for the handler's metadata."""

    _fields_ = [("base", Extension), ("metadata", ctypes.POINTER(Metadata))]


class Buffer(ctypes.Structure):
    """XLA_FFI_Buffer: one argument or result (element type, data, shape)."""

    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("dtype", ctypes.c_int), ("data", ctypes.c_void_p), ("rank", ctypes.c_int64),
                ("dims", _c_int64_p)]


class Items(ctypes.Structure):
    """XLA_FFI_Args and XLA_FFI_Rets: a call's buffers."""

    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("size", ctypes.c_int64), ("types", ctypes.c_void_p),
                ("items", ctypes.POINTER(ctypes.POINTER(Buffer)))]


class Scalar(ctypes.Structure):
    """XLA_FFI_Scalar: a scalar attribute (here the int64 ``key``)."""

    _fields_ = [("dtype", ctypes.c_int), ("value", _c_int64_p)]


class Attrs(ctypes.Structure):
    """XLA_FFI_Attrs: a call's attributes."""

    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("size", ctypes.c_int64), ("types", ctypes.c_void_p), ("names", ctypes.c_void_p),
                ("items", ctypes.POINTER(ctypes.POINTER(Scalar)))]


class ErrorArgs(ctypes.Structure):
    """XLA_FFI_Error_Create_Args: an error's message and code."""

    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("message", ctypes.c_char_p), ("errc", ctypes.c_int)]


class StreamArgs(ctypes.Structure):
    """XLA_FFI_Stream_Get_Args: asks for the call's device stream."""

    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("ctx", ctypes.c_void_p), ("stream", ctypes.c_void_p)]


ErrorCreate = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.POINTER(ErrorArgs))
StreamGet = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.POINTER(StreamArgs))


class Api(ctypes.Structure):
    """The leading fields of XLA_FFI_Api, in order: the functions this handler calls."""

    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("api_version", ApiVersion), ("internal_api", ctypes.c_void_p),
                ("error_create", ErrorCreate), ("error_get_message", ctypes.c_void_p),
                ("error_destroy", ctypes.c_void_p), ("handler_register", ctypes.c_void_p),
                ("stream_get", StreamGet)]


class CallFrame(ctypes.Structure):
    """XLA_FFI_CallFrame: one call, as the handler receives it."""

    _fields_ = [("struct_size", ctypes.c_size_t),
                ("extension_start", ctypes.POINTER(Extension)),
                ("api", ctypes.POINTER(Api)), ("ctx", ctypes.c_void_p), ("stage", ctypes.c_int),
                ("args", Items), ("rets", Items), ("attrs", Attrs),
                ("future", ctypes.c_void_p)]


class _HostBytes:
    """``nbytes`` bytes of host memory at ``address``, in NumPy's array interface."""

    def __init__(self, address: int, nbytes: int):
        self.__array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                    "data": (address, False), "version": 3}


def _layout(buffer: Buffer) -> tuple[tuple[int, ...], np.dtype]:
    """The shape and NumPy dtype of an XLA buffer; a TypeError for a type no call takes."""
    if buffer.dtype not in _DTYPES:
        raise TypeError(f"an argument of XLA element type {buffer.dtype} (not an integer, bool "
                        "or float16 / bfloat16 / float32 / float64 array)")
    return tuple(buffer.dims[i] for i in range(buffer.rank)), np.dtype(_DTYPES[buffer.dtype])


def _host_view(buffer: Buffer, result: bool = False) -> np.ndarray:
    """A NumPy array over an XLA host buffer, in place (a large ``result``'s whole pages
    advised to be huge pages)."""
    shape, dtype = _layout(buffer)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes == 0:
        return np.empty(shape, dtype)
    if result and nbytes >= _HUGE_RESULT:
        first = -(-buffer.data // mmap.PAGESIZE) * mmap.PAGESIZE
        last = (buffer.data + nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
        _LIBC.madvise(first, last - first, _MADV_HUGEPAGE)  # advice: a failure changes nothing
    return np.asarray(_HostBytes(buffer.data, nbytes)).view(dtype).reshape(shape)


def _device_view(buffer: Buffer, result: bool = False):
    """A CuPy array over an XLA device buffer, in place (bfloat16 as its uint16 bits; results
    are not advised: device memory)."""
    import cupy

    shape, dtype = _layout(buffer)
    dtype = np.dtype(np.uint16) if dtype == ml_dtypes.bfloat16 else dtype
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes == 0:
        return cupy.empty(shape, dtype)
    memory = cupy.cuda.UnownedMemory(buffer.data, nbytes, None)
    return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(memory, 0))


def _device_stream(frame: CallFrame, buffers: list):
    """XLA's CUDA stream of this call, as a CuPy stream of the device of ``buffers`` (CuPy
    views), so that kernels launch on the GPU that XLA runs the call on."""
    import cupy

    args = StreamArgs(ctypes.sizeof(StreamArgs), None, frame.ctx, None)
    if frame.api.contents.stream_get(ctypes.byref(args)):
        raise RuntimeError("XLA gave no CUDA stream to the custom call")
    device = buffers[0].device.id if buffers else cupy.cuda.runtime.getDevice()
    return cupy.cuda.ExternalStream(args.stream or 0, device)


class BoundCall:
    """What a custom call's key names: ``function`` bound to ``owner`` (held weakly) and
    ``extra``; kept alive by its owner (``function_key``), resolved through the handles."""

    __slots__ = ("owner", "function", "extra", "__weakref__")

    def __init__(self, owner: Any, function: Callable[..., None], extra: tuple):
        self.owner = weakref.ref(owner)
        self.function, self.extra = function, extra

    def __call__(self, inputs: list, outputs: list, stream: Any) -> None:
        """Run the function on the call's buffers; a RuntimeError once the owner is gone."""
        owner = self.owner()
        if owner is None:
            raise RuntimeError("the object this jitted call was traced with is gone")
        self.function(owner, self.extra, inputs, outputs, stream)


_KEYS: dict[tuple, int] = {}  # (function, id(owner), extra) -> its BoundCall's handle
_RAISED: OrderedDict[str, BaseException] = OrderedDict()  # the latest failures, by message
_LOCK = threading.Lock()


def _fail(frame: CallFrame, error: BaseException) -> int:
    """An XLA error holding ``error``'s type and message; the exception itself is kept (without
    its traceback, which holds the call's buffers) for an eager caller to raise again."""
    message = f"{type(error).__name__}: {error}"
    with _LOCK:
        _RAISED[message] = error.with_traceback(None)
        while len(_RAISED) > 16:
            _RAISED.popitem(last=False)
    args = ErrorArgs(ctypes.sizeof(ErrorArgs), None, message.encode(), _UNKNOWN)
    return frame.api.contents.error_create(ctypes.byref(args))


def handle(frame_pointer, on_device: bool) -> int | None:
    """The FFI handler: answer XLA's metadata query, or run the function of the call's key."""
    frame = frame_pointer.contents
    if frame.extension_start and frame.extension_start.contents.type == _METADATA:
        metadata = ctypes.cast(frame.extension_start,
                               ctypes.POINTER(MetadataExtension)).contents.metadata.contents
        metadata.api_version.major, metadata.api_version.minor = _API_VERSION
        metadata.traits = 0  # not capturable in command buffers (CUDA graphs)
        return None
    if frame.stage != _EXECUTE:
        return None
    try:
        call = handles.resolve(frame.attrs.items[0].contents.value.contents.value)
        view = _device_view if on_device else _host_view
        inputs = [view(frame.args.items[i].contents) for i in range(frame.args.size)]
        outputs = [view(frame.rets.items[i].contents, True) for i in range(frame.rets.size)]
        stream = _device_stream(frame, inputs + outputs) if on_device else None
        call(inputs, outputs, stream)
        return None
    except BaseException as error:  # noqa: BLE001  every failure goes back to XLA as an error
        return _fail(frame, error)


_HANDLER_TYPE = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.POINTER(CallFrame))
_HANDLERS: list[Any] = []  # the registered ctypes functions, alive while the process is


def _register() -> None:
    """Register the handler for the CPU, and for CUDA where jaxlib can take it (once)."""
    if _HANDLERS:
        return
    with _LOCK:
        if _HANDLERS:
            return
        for platform, on_device in (("cpu", False), ("CUDA", True)):
            handler = _HANDLER_TYPE(lambda frame, on_device=on_device: handle(frame, on_device))
            try:
                jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(handler), platform=platform)
            except Exception:  # noqa: BLE001  no CUDA plugin: the CPU target alone
                continue
            _HANDLERS.append(handler)


def function_key(owner: Any, function: Callable[..., None], extra: tuple) -> int:
    """The key of ``function`` bound to ``owner`` (held weakly) and ``extra``: the handle of
    one ``BoundCall`` per distinct triple, so jax caches one compiled call for each; the call
    lives as long as the owner (its finalizer holds it) and its handle goes with it."""
    index = (function, id(owner), extra)
    with _LOCK:
        key = _KEYS.get(index)
        if key is None:
            call = BoundCall(owner, function, extra)
            key = _KEYS[index] = handles.register(call)
            weakref.finalize(owner, _forget, index, call)
    return key


def _forget(index: tuple, call: BoundCall) -> None:
    """Drop the key of an owner that is gone (and, returning, the last hold on its call)."""
    with _LOCK:
        _KEYS.pop(index, None)


def bound_calls() -> list[BoundCall]:
    """The calls bound so far whose owners live (one per key), for tests and inspection."""
    with _LOCK:
        keys = list(_KEYS.values())
    return [handles.resolve(key) for key in keys]


@functools.lru_cache(maxsize=256)
def _call(key: int, results: tuple, side_effect: bool):
    """The jitted custom call of ``key`` (jit's own dispatch: tens of microseconds less per
    eager call than binding the primitive; inlined when traced inside another function)."""
    call = jax.ffi.ffi_call(TARGET, list(results), has_side_effect=side_effect,
                            vmap_method="sequential")
    return jax.jit(functools.partial(call, key=np.int64(key)))


def custom_call(owner: Any, function: Callable[..., None], extra: tuple,
                results: Sequence[jax.ShapeDtypeStruct], *args, side_effect: bool = False):
    """Call ``function(owner, extra, inputs, outputs, stream)`` on ``args``' buffers as one XLA
    custom call with ``results``, and return the list of result arrays: traced under
    ``jax.jit``; outside it run at once, after every side-effecting call dispatched before it
    (``jax.effects_barrier``), and waited for, a failure raising the Python exception the
    function raised (an IndexError stays an IndexError), not XLA's wrapper of it.
    ``side_effect``: never removed or merged with another call."""
    _register()
    call = _call(function_key(owner, function, extra), tuple(results), side_effect)
    if any(isinstance(arg, jax.core.Tracer) for arg in args):
        return call(*args)
    jax.effects_barrier()  # side-effecting calls dispatched before this one (row updates) first
    try:
        return jax.block_until_ready(call(*args))
    except jax.errors.JaxRuntimeError as error:
        text = str(error)
        with _LOCK:
            found = [message for message in _RAISED if message in text]
            raised = _RAISED.pop(found[-1]) if found else None
        if raised is None:
            raise
        raise raised from None
