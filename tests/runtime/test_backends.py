"""Array sides on the CPU: torch tensors zero-copy in and out (torch in gives torch out, out= is
returned), DLPack, device mixing, stream choice and the DLPack handoff to torch."""

from __future__ import annotations

import types as pytypes

import numpy as np
import pytest
import torch

import ngram_cupy as nc
from ngram_cupy.formats import storage_format
from ngram_cupy.hashing import reference
from ngram_cupy.runtime import backends

LAYOUT = nc.layer_layout(nc.NGramConfig(300, 3, 2, 40, 7), 0)
TOKENS = np.array([5, 7, 7, 1, 9, 2, 299, 0], dtype=np.int64)
STARTS = np.array([0, 3, 3, 8], dtype=np.int64)
CONTEXT = np.array([[7, 7], [1, 2], [3, 4], [0, 0]], dtype=np.int64)  # a spare last row


class FakeDeviceArray:
    """Just enough of ``__cuda_array_interface__`` to be recognised as a GPU array."""

    def __init__(self, array: np.ndarray):
        self.__cuda_array_interface__ = dict(
            shape=array.shape, typestr=array.dtype.str, data=(0x7F0000000000, False), version=3
        )


class FakeDLPack:
    """A DLPack producer on a device type the library does not handle (Vulkan)."""

    def __dlpack_device__(self):
        return 7, 0


def shares(numpy_array: np.ndarray, tensor: torch.Tensor) -> bool:
    """Whether a NumPy array and a torch tensor start at the same memory."""
    return numpy_array.__array_interface__["data"][0] == tensor.data_ptr()


@pytest.mark.parametrize(
    "value, side",
    [(TOKENS, backends.HOST), (torch.from_numpy(TOKENS), backends.HOST), ([1, 2], None), (3, None),
     (FakeDeviceArray(TOKENS), backends.DEVICE), (np.int64(3), backends.HOST)],
)
def test_where(value, side):
    assert backends.where(value) == side


def test_unsupported_dlpack_device_is_refused():
    with pytest.raises(TypeError, match="DLPack device type 7"):
        backends.where(FakeDLPack())


def test_torch_cpu_tensors_are_viewed_not_copied():
    tensors = {name: torch.from_numpy(a.copy()) for name, a in
               dict(input_ids=TOKENS, query_start_loc=STARTS, ngram_context=CONTEXT).items()}
    side, converted = backends.convert(**tensors, out=None, extra=[0, 1])
    assert side == backends.HOST and converted["out"] is None
    np.testing.assert_array_equal(converted["extra"], [0, 1])
    for name, tensor in tensors.items():
        assert isinstance(converted[name], np.ndarray) and shares(converted[name], tensor)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_torch_cpu_in_torch_out(dtype):
    ids = nc.compute_ngram_ids(LAYOUT, torch.from_numpy(TOKENS).to(dtype),
                               torch.from_numpy(STARTS).to(dtype), torch.from_numpy(CONTEXT))
    assert isinstance(ids, torch.Tensor) and ids.dtype == torch.int64
    np.testing.assert_array_equal(ids.numpy(),
                                  reference.compute_ngram_ids(LAYOUT, TOKENS, STARTS, CONTEXT))
    ids = nc.compute_ngram_ids(LAYOUT, TOKENS, STARTS, CONTEXT)  # NumPy in, NumPy out
    assert isinstance(ids, np.ndarray)


def test_torch_out_is_written_in_place_and_returned():
    out = torch.full((len(TOKENS), LAYOUT.num_heads), -1, dtype=torch.int64)
    for tokens in (torch.from_numpy(TOKENS), TOKENS):  # whatever the inputs: out comes back
        assert nc.compute_ngram_ids(LAYOUT, tokens, STARTS, CONTEXT, out=out) is out
    np.testing.assert_array_equal(out.numpy(), reference.compute_ngram_ids(LAYOUT, TOKENS, STARTS,
                                                                           CONTEXT))


def test_torch_context_rolled_in_place():
    context = torch.from_numpy(CONTEXT.copy())
    expected = reference.advance_context(LAYOUT, TOKENS, STARTS, CONTEXT)
    nc.advance_context(LAYOUT, torch.from_numpy(TOKENS), STARTS, context, out=context[:3])
    np.testing.assert_array_equal(context[:3].numpy(), expected)
    np.testing.assert_array_equal(context[3].numpy(), CONTEXT[3])


def test_dlpack_round_trip_shares_memory():
    ids = nc.compute_ngram_ids(LAYOUT, TOKENS, STARTS, CONTEXT)
    tensor = torch.from_dlpack(ids)
    assert shares(ids, tensor) and tensor.dtype == torch.int64
    back = np.from_dlpack(tensor)
    assert shares(back, tensor)
    np.testing.assert_array_equal(back, ids)


@pytest.mark.parametrize("device_argument",
                         ["input_ids", "query_start_loc", "ngram_context", "out"])
def test_host_and_device_arguments_do_not_mix(device_argument):
    args = dict(input_ids=TOKENS, query_start_loc=STARTS, ngram_context=CONTEXT,
                out=np.empty((len(TOKENS), LAYOUT.num_heads), dtype=np.int64))
    args[device_argument] = FakeDeviceArray(args[device_argument])
    with pytest.raises(ValueError, match=f"{device_argument} on the GPU but .* on the CPU"):
        nc.compute_ngram_ids(LAYOUT, **args)
    args["out"] = FakeDeviceArray(CONTEXT[:3]) if device_argument == "out" else None
    with pytest.raises(ValueError, match="on different devices"):
        nc.advance_context(LAYOUT, **args)


def test_plain_sequences_follow_the_arrays():
    assert backends.placement(a=[0, 1], b=None) == backends.HOST
    assert backends.placement(a=[0, 1], b=FakeDeviceArray(TOKENS)) == backends.DEVICE
    ids = nc.compute_ngram_ids(LAYOUT, TOKENS.tolist(), STARTS.tolist(), CONTEXT.tolist())
    np.testing.assert_array_equal(ids, nc.compute_ngram_ids(LAYOUT, TOKENS, STARTS, CONTEXT))


def test_stream_with_host_arrays_is_refused():
    with pytest.raises(ValueError, match="stream"):
        nc.compute_ngram_ids(LAYOUT, TOKENS, STARTS, CONTEXT, stream=object())
    with pytest.raises(ValueError, match="stream"):
        nc.advance_context(LAYOUT, torch.from_numpy(TOKENS), STARTS, CONTEXT, stream=object())


class ProtocolStream:
    """A foreign stream in the CUDA stream protocol."""

    def __cuda_stream__(self):
        return 0, 0x5000


class OldTorchStream:
    """A stream that only exposes ``cuda_stream``, as torch did before the protocol."""

    cuda_stream = 0x6000


def test_cuda_stream_accepts_cupy_torch_and_protocol_streams():
    cupy = pytest.importorskip("cupy")
    assert backends.cuda_stream(cupy.cuda.Stream.null) is cupy.cuda.Stream.null
    assert backends.cuda_stream(ProtocolStream()).ptr == 0x5000
    assert backends.cuda_stream(OldTorchStream()).ptr == 0x6000
    assert backends.cuda_stream(ProtocolStream()) is backends.cuda_stream(ProtocolStream())


@pytest.mark.parametrize("stream", ["default", 5, True, 1.5, object()])
def test_bad_stream_is_refused(stream):
    pytest.importorskip("cupy")
    with pytest.raises(TypeError, match="stream must be"):
        backends.cuda_stream(stream)
    device = {name: FakeDeviceArray(a) for name, a in
              dict(input_ids=TOKENS, query_start_loc=STARTS, ngram_context=CONTEXT).items()}
    with pytest.raises(TypeError, match="stream must be"):  # refused before any device work
        nc.compute_ngram_ids(LAYOUT, **device, stream=stream)


def test_bfloat16_results_go_back_to_torch_typed():
    import ml_dtypes

    bits = np.arange(6, dtype=np.uint16).reshape(2, 3)
    fmt = storage_format("bfloat16")
    tensor = backends.HOST.to_torch(bits.view(ml_dtypes.bfloat16), fmt)
    assert tensor.dtype == torch.bfloat16 and tensor.data_ptr() == bits.ctypes.data
    np.testing.assert_array_equal(tensor.view(torch.int16).numpy(), bits.view(np.int16))


class RecordingStream:
    """A CuPy-like stream that records when it is entered and left."""

    def __init__(self, log, name):
        self.log, self.name = log, name

    def __enter__(self):
        self.log.append(("enter", self.name))
        return self

    def __exit__(self, *exc):
        self.log.append(("exit", self.name))


def test_device_results_are_handed_to_torch_from_the_producing_stream(monkeypatch):
    """DLPack orders torch's current stream after CuPy's current one: the handoff must happen
    with the producing stream current, so a lookup on another stream is not read early."""
    log = []
    producer = RecordingStream(log, "producer")
    monkeypatch.setattr(torch, "from_dlpack", lambda array: log.append(("from_dlpack", array))
                        or torch.zeros(1))
    backends.DEVICE.to_torch("rows", None, producer)
    assert log == [("enter", "producer"), ("from_dlpack", "rows"), ("exit", "producer")]


def test_torch_inputs_run_on_torchs_current_stream(monkeypatch):
    """With torch inputs and no stream, kernels run on torch's current stream: a torch caller
    (a graph capture included) then sees no cross-stream event in either DLPack handoff."""
    pytest.importorskip("cupy")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: ProtocolStream())
    assert backends.DEVICE.kernel_stream(None, prefer_torch=True).ptr == 0x5000
    assert backends.DEVICE.kernel_stream(OldTorchStream(), prefer_torch=True).ptr == 0x6000


# --- several GPUs: everything follows the arrays' device, not the current one ---------------


@pytest.fixture
def two_gpus(monkeypatch):
    """A stand-in CuPy whose current device is 0, with tensors on device 1."""
    from fake_cupy import FakeCupy

    cupy = FakeCupy()
    monkeypatch.setattr(backends, "cupy_module", lambda: cupy)
    backends._external_stream.cache_clear()
    yield cupy
    backends._external_stream.cache_clear()


class TorchStream:
    """A torch-like stream on one device (``device.index``), in the CUDA stream protocol."""

    def __init__(self, index, handle=0x7000):
        self.device = torch.device("cuda", index)
        self.handle = handle

    def __cuda_stream__(self):
        return 0, self.handle


def test_torch_inputs_on_another_gpu_run_on_that_gpus_torch_stream(two_gpus, monkeypatch):
    """Bug: torch.cuda.current_stream() is the current device's stream: kernels for tensors on
    GPU 1 were queued on GPU 0's stream."""
    asked = []
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: asked.append(device) or TorchStream(device))
    stream = backends.DEVICE.kernel_stream(None, prefer_torch=True, device=1)
    assert asked == [1] and stream.device_id == 1 and stream.ptr == 0x7000


def test_cupys_current_stream_and_foreign_streams_follow_the_device(two_gpus):
    assert backends.cuda_stream(None, device=1).device_id == 1  # GPU 1's current stream
    assert two_gpus.current == 0  # left as it was
    assert backends.cuda_stream(None).device_id == 0
    assert backends.cuda_stream(TorchStream(1, 0x8000), device=0).device_id == 1  # its own
    assert backends.cuda_stream(ProtocolStream(), device=1).device_id == 1  # the arrays'


def test_entering_a_stream_makes_its_device_current(two_gpus):
    """Allocations and launches inside ``on(stream)`` go to the stream's GPU."""
    stream = two_gpus.cuda.Stream(device_id=1, ptr=0x9000)
    with backends.DEVICE.on(stream):
        assert two_gpus.current == 1
    assert two_gpus.current == 0
    assert two_gpus.log[-2:] == [("device", 1), ("stream", 0x9000, 1)]


def test_device_index_reads_dlpack_and_cupy_devices():
    class OnGpu:
        def __dlpack_device__(self):
            return 2, 3

    class CupyLike:
        device = pytypes.SimpleNamespace(id=2)

    assert backends.device_index(OnGpu()) == 3 and backends.device_index(CupyLike()) == 2
    assert backends.device_index(np.zeros(2)) is None and backends.device_index(FakeDLPack()) \
        is None


@pytest.mark.gpu
def test_tensors_on_the_second_gpu_while_the_first_is_current():
    """On a machine with two GPUs: ids and a lookup of tensors on cuda:1, cuda:0 current."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    weight = np.random.default_rng(1).standard_normal((LAYOUT.padded_rows, 4)).astype(
        np.float32)
    torch.cuda.set_device(0)
    tensors = [torch.from_numpy(a).to("cuda:1") for a in (TOKENS, STARTS, CONTEXT)]
    ids = nc.compute_ngram_ids(LAYOUT, *tensors)
    assert ids.device == torch.device("cuda", 1)
    table = nc.EmbeddingTable(weight, placement="pinned")
    table.prefetch(ids)
    rows = table.lookup(ids)
    assert rows.device == torch.device("cuda", 1)
    torch.cuda.synchronize(1)
    want = nc.EmbeddingTable(weight).lookup(reference.compute_ngram_ids(LAYOUT, TOKENS, STARTS,
                                                                         CONTEXT))
    np.testing.assert_array_equal(rows.cpu().numpy(), want)
