"""Array interop on the CPU: torch tensors zero-copy in and out, DLPack, device mixing, streams."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ngram_cupy as nc
from ngram_cupy import arrays, reference

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
    [(TOKENS, arrays.HOST), (torch.from_numpy(TOKENS), arrays.HOST), ([1, 2], None), (3, None),
     (FakeDeviceArray(TOKENS), arrays.DEVICE), (np.int64(3), arrays.HOST)],
)
def test_where(value, side):
    assert arrays.where(value) == side


def test_unsupported_dlpack_device_is_refused():
    with pytest.raises(TypeError, match="DLPack device type 7"):
        arrays.where(FakeDLPack())


def test_torch_cpu_tensors_are_viewed_not_copied():
    tensors = {name: torch.from_numpy(a.copy()) for name, a in
               dict(input_ids=TOKENS, query_start_loc=STARTS, ngram_context=CONTEXT).items()}
    side, converted = arrays.convert(**tensors, out=None, extra=[0, 1])
    assert side == arrays.HOST and converted["out"] is None
    np.testing.assert_array_equal(converted["extra"], [0, 1])
    for name, tensor in tensors.items():
        assert isinstance(converted[name], np.ndarray) and shares(converted[name], tensor)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_torch_cpu_in_numpy_out(dtype):
    ids = nc.compute_ngram_ids(LAYOUT, torch.from_numpy(TOKENS).to(dtype),
                               torch.from_numpy(STARTS).to(dtype), torch.from_numpy(CONTEXT))
    assert isinstance(ids, np.ndarray)
    np.testing.assert_array_equal(ids, reference.compute_ngram_ids(LAYOUT, TOKENS, STARTS, CONTEXT))


def test_torch_out_is_written_in_place():
    out = torch.full((len(TOKENS), LAYOUT.num_heads), -1, dtype=torch.int64)
    ids = nc.compute_ngram_ids(LAYOUT, torch.from_numpy(TOKENS), STARTS, CONTEXT, out=out)
    assert shares(ids, out)
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
    assert arrays.placement(a=[0, 1], b=None) == arrays.HOST
    assert arrays.placement(a=[0, 1], b=FakeDeviceArray(TOKENS)) == arrays.DEVICE
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
    assert arrays.cuda_stream(cupy.cuda.Stream.null) is cupy.cuda.Stream.null
    assert arrays.cuda_stream(ProtocolStream()).ptr == 0x5000
    assert arrays.cuda_stream(OldTorchStream()).ptr == 0x6000
    assert arrays.cuda_stream(ProtocolStream()) is arrays.cuda_stream(ProtocolStream())


@pytest.mark.parametrize("stream", ["default", 5, True, 1.5, object()])
def test_bad_stream_is_refused(stream):
    pytest.importorskip("cupy")
    with pytest.raises(TypeError, match="stream must be"):
        arrays.cuda_stream(stream)
    device = {name: FakeDeviceArray(a) for name, a in
              dict(input_ids=TOKENS, query_start_loc=STARTS, ngram_context=CONTEXT).items()}
    with pytest.raises(TypeError, match="stream must be"):  # refused before any device work
        nc.compute_ngram_ids(LAYOUT, **device, stream=stream)
