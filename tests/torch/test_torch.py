"""NGramEmbeddingModule: the reference layer's torch shape over exact ids and table lookups."""

from __future__ import annotations

import inspect
import io
import json
import pydoc
import re
import tracemalloc

import ml_dtypes
import numpy as np
import pytest
import torch
from conftest import GOLDEN_FILES, load_ngram_golden
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ngram_cupy as nc
from ngram_cupy.hashing import reference
from ngram_cupy.hashing.layout import split_rows
from ngram_cupy.runtime.backends import HOST
from ngram_cupy.tables.prefetch import STAGING_SHAPES
from ngram_cupy.torch import NGramEmbeddingModule

# Storage dtype name -> (NumPy type, integer type of the same width, scale or None).
DTYPES = {
    "float8_e4m3fn": (ml_dtypes.float8_e4m3fn, np.uint8, 0.375),
    "bfloat16": (ml_dtypes.bfloat16, np.int16, None),
    "float16": (np.float16, np.int16, None),
    "float32": (np.float32, np.int32, None),
}
BUFFER_NAMES = ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")
SETTINGS = settings(max_examples=15, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def configs(draw, split_ngram_parts=None):
    """Small random configs (tables of a few hundred rows) and a PLE layer index."""
    vocab_size = draw(st.integers(3, 60))
    # Both orders and head counts, in the two shapes the other tests compile already: each
    # further (n, k) pair is a kernel compile, not a new path.
    ngram_size, heads_per_ngram = draw(st.sampled_from([(2, 1), (3, 2)]))
    num_heads = (ngram_size - 1) * heads_per_ngram
    config = nc.NGramConfig(
        vocab_size=vocab_size, ngram_size=ngram_size, heads_per_ngram=heads_per_ngram,
        ngram_vocab_size_base=draw(st.integers(2, 40)),
        eos_token_id=draw(st.integers(0, vocab_size - 1)),
        embedding_dim=num_heads * draw(st.integers(1, 4)), seed=draw(st.integers(0, 10**6)),
        make_ngram_vocab_size_divisible_by=draw(st.integers(1, 8)),
        split_ngram_parts=split_ngram_parts or draw(st.integers(1, 6)),
    )
    return config, draw(st.integers(0, 2))


@st.composite
def sequences(draw, config, max_requests=4, max_len=8):
    """Requests' tokens (EOS often) and their contexts, as lists."""
    eos = config.eos_token_id
    token = st.one_of(st.just(eos), st.integers(0, config.vocab_size - 1))
    count = draw(st.integers(0, max_requests))
    tokens = [draw(st.lists(token, max_size=max_len)) for _ in range(count)]
    contexts = [draw(st.lists(token, min_size=config.ngram_size - 1,
                              max_size=config.ngram_size - 1)) for _ in range(count)]
    return tokens, contexts


def packed(config, tokens, contexts, spare_rows=0):
    """``(input_ids, query_start_loc, ngram_context)`` torch tensors of requests' token lists;
    ``spare_rows`` extra context rows, as a persistent engine buffer has."""
    input_ids = torch.tensor([t for request in tokens for t in request], dtype=torch.int64)
    starts = torch.tensor(np.cumsum([0] + [len(request) for request in tokens]))
    rows = [*contexts, *[[config.eos_token_id] * (config.ngram_size - 1)] * spare_rows]
    context = torch.tensor(rows, dtype=torch.int64).reshape(-1, config.ngram_size - 1)
    return input_ids, starts, context


def random_rows(rows: int, head_dim: int, dtype_name: str, seed: int) -> np.ndarray:
    """Random bit patterns (NaNs and infinities included) as a ``[rows, head_dim]`` table."""
    values, bits, _ = DTYPES[dtype_name]
    raw = np.random.default_rng(seed).integers(np.iinfo(bits).min, np.iinfo(bits).max,
                                               (rows, head_dim), dtype=bits, endpoint=True)
    return raw.view(values)


def as_torch(array: np.ndarray) -> torch.Tensor:
    """A torch tensor of a NumPy / ml_dtypes array (a copy), of the same dtype."""
    bits = {1: np.uint8, 2: np.int16, 4: np.int32}[array.dtype.itemsize]
    return torch.from_numpy(array.view(bits).copy()).view(getattr(torch, array.dtype.name))


def bits(tensor: torch.Tensor) -> np.ndarray:
    """The bit patterns of a tensor's values, to compare NaNs exactly."""
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
    return tensor.cpu().view(width).numpy()


def checkpoint_weights(config, layer, weight, scale):
    """The layer's checkpoint entries, named relative to the layer, shard by shard."""
    layout = nc.layer_layout(config, layer)
    parts = config.split_ngram_parts
    yield "layer_multipliers", torch.tensor(layout.multipliers)
    yield "ngram_heads_vocab_sizes", torch.tensor(layout.head_sizes)
    yield "ngram_heads_offsets", torch.tensor(layout.head_offsets)
    yield "ngram_embedding.hashstats_counts", torch.zeros(3)
    for index in range(parts):
        start, stop = split_rows(layout.padded_rows, parts, index)
        yield f"ngram_embedding.shard_{index}.weight", as_torch(weight[start:stop])
    if scale is not None:
        yield "ngram_embedding.weight_scale", torch.tensor(scale, dtype=torch.bfloat16)
    yield "token_lookup", torch.zeros(2)


def loaded_module(config, layer, dtype_name, seed=0, placement="cpu", **options):
    """A module with random rows loaded through ``load_weights``, and those rows and scale."""
    layout = nc.layer_layout(config, layer)
    weight = random_rows(layout.padded_rows, layout.head_dim, dtype_name, seed)
    scale = DTYPES[dtype_name][2]
    module = NGramEmbeddingModule(config, layer, placement=placement, weight_dtype=dtype_name,
                                  **options)
    module.load_weights(checkpoint_weights(config, layer, weight, scale))
    return module, weight, scale


def expected_rows(config, layer, weight, scale, input_ids, starts, context) -> np.ndarray:
    """EmbeddingTable lookups of the reference ids: what ``forward`` must return."""
    layout = nc.layer_layout(config, layer)
    ids = reference.compute_ngram_ids(layout, input_ids.numpy(), starts.numpy(), context.numpy())
    return nc.EmbeddingTable(weight, scale=scale).lookup(ids)


def small_config(**changes):
    values = dict(vocab_size=40, ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=25,
                  eos_token_id=3, embedding_dim=12, make_ngram_vocab_size_divisible_by=4,
                  split_ngram_parts=4)
    return nc.NGramConfig(**{**values, **changes})


@pytest.mark.parametrize("dtype_name", DTYPES)
@SETTINGS
@given(data=st.data())
def test_forward_is_table_lookup_of_reference_ids(dtype_name, data):
    config, layer = data.draw(configs())
    tokens, contexts = data.draw(sequences(config))
    batch = packed(config, tokens, contexts, spare_rows=data.draw(st.integers(0, 2)))
    module, weight, scale = loaded_module(config, layer, dtype_name, data.draw(st.integers(0, 9)))
    hidden_states = torch.zeros(len(batch[0]), 5)
    result = module(hidden_states, *batch)
    want = expected_rows(config, layer, weight, scale, *batch)
    assert result.dtype == module.out_dtype
    assert result.shape == (len(batch[0]), config.embedding_dim)
    np.testing.assert_array_equal(bits(result), want.view(bits(result).dtype))


@SETTINGS
@given(data=st.data())
def test_ids_are_the_reference_ids(data):
    config, layer = data.draw(configs())
    tokens, contexts = data.draw(sequences(config))
    input_ids, starts, context = packed(config, tokens, contexts)
    module = NGramEmbeddingModule(config, layer, placement="cpu", weight_dtype=torch.float16)
    layout = nc.layer_layout(config, layer)
    want = reference.compute_ngram_ids(layout, input_ids.numpy(), starts.numpy(),
                                       context.numpy())
    ids = module.compute_ngram_ids(input_ids.int(), starts.int(), context.int())
    assert ids.dtype == torch.int64
    np.testing.assert_array_equal(ids.numpy(), want)
    output = torch.full_like(ids, -1)
    assert module.compute_ngram_ids(input_ids, starts, context, output=output) is output
    np.testing.assert_array_equal(output.numpy(), want)


@pytest.mark.parametrize("path", [p for p in GOLDEN_FILES
                                  if json.loads(p.read_text())["layout"]["padded_rows"] < 1 << 21],
                         ids=lambda p: p.stem)
def test_ids_are_the_golden_ids(path):
    """The reference model's own ids, for the golden layouts small enough for a table here."""
    layout, _, batches = load_ngram_golden(path)
    config = nc.NGramConfig(**{**vars(layout.config), "embedding_dim": layout.num_heads})
    module = NGramEmbeddingModule(config, layout.layer, placement="cpu", weight_dtype="fp8")
    for batch in batches:
        ids = module.compute_ngram_ids(*(torch.from_numpy(batch[name]) for name in
                                         ("input_ids", "query_start_loc", "ngram_context")))
        np.testing.assert_array_equal(ids.numpy(), batch["ngram_ids"])


@SETTINGS
@given(data=st.data())
def test_chunked_prefill_then_decode_equals_whole(data):
    config, layer = data.draw(configs())
    tokens, contexts = data.draw(sequences(config, max_len=10))
    module, _, _ = loaded_module(config, layer, "float8_e4m3fn")
    layout = nc.layer_layout(config, layer)
    whole = module(None, *packed(config, tokens, contexts))
    # Each request: a few prefill chunks (maybe empty), then one token per decode step.
    schedules = []
    for request in tokens:
        prefill = data.draw(st.integers(0, len(request)))
        cuts = sorted(data.draw(st.lists(st.integers(0, prefill), max_size=3)))
        sizes = np.diff([0, *cuts, prefill]).tolist() + [1] * (len(request) - prefill)
        schedules.append(sizes)
    steps = max((len(s) for s in schedules), default=0)
    context = packed(config, tokens, contexts)[2]
    done = [0] * len(tokens)
    pieces = [[] for _ in tokens]
    for step in range(steps):
        chunk = []
        for r, sizes in enumerate(schedules):
            size = sizes[step] if step < len(sizes) else 0
            chunk.append(tokens[r][done[r]:done[r] + size])
            done[r] += size
        input_ids, starts, _ = packed(config, chunk, [])
        rows = module(None, input_ids, starts, context)
        for r in range(len(tokens)):
            pieces[r].append(rows[starts[r]:starts[r + 1]])
        context = torch.as_tensor(np.asarray(nc.advance_context(layout, input_ids, starts,
                                                                context)))
    chunked = torch.cat([p for request in pieces for p in request] or [whole[:0]])
    np.testing.assert_array_equal(bits(chunked), bits(whole))


@pytest.mark.parametrize("placement", ["cpu", "pinned"])
@SETTINGS
@given(data=st.data())
def test_prefetch_then_forward_equals_forward(placement, data):
    config, layer = data.draw(configs())
    module, _, _ = loaded_module(config, layer, "bfloat16", placement=placement)
    batch = packed(config, *data.draw(sequences(config)))
    other = packed(config, *data.draw(sequences(config)))
    alone = module(None, *batch)
    module.start_prefetch(None, *batch)
    np.testing.assert_array_equal(bits(module(None, *batch)), bits(alone))
    module.start_prefetch(None, *other)  # stale: the forward asks for other rows
    np.testing.assert_array_equal(bits(module(None, *batch)), bits(alone))


def padded(batch, padding):
    """``batch`` with ``padding`` tokens appended past ``query_start_loc[-1]`` (SPEC 10.3), and
    the same tokens with the last request extended over them."""
    input_ids, starts, context = batch
    tokens = torch.cat([input_ids, torch.tensor(padding, dtype=input_ids.dtype)])
    extended = starts.clone()
    extended[-1] = tokens.numel()
    return (tokens, starts, context), (tokens, extended, context)


@pytest.mark.parametrize("placement", ["cpu", "pinned"])
@SETTINGS
@given(data=st.data())
def test_padded_batches_through_forward_and_prefetch(placement, data):
    """Padding leaves the real tokens' rows alone and gives the padded ones the rows of tokens
    appended to the last request, with and without a prefetch, in both call shapes."""
    config, layer = data.draw(configs())
    tokens, contexts = data.draw(sequences(config))
    tokens = tokens or [[]]
    contexts = contexts or [[config.eos_token_id] * (config.ngram_size - 1)]
    batch = packed(config, tokens, contexts)
    pad = data.draw(st.lists(st.integers(0, config.vocab_size - 1), min_size=1, max_size=9))
    padded_batch, appended = padded(batch, pad)
    module, _, _ = loaded_module(config, layer, "float8_e4m3fn", placement=placement)
    real = module(*batch)
    want = module(*appended)
    np.testing.assert_array_equal(bits(want[: len(batch[0])]), bits(real))
    np.testing.assert_array_equal(bits(module(None, *padded_batch)), bits(want))
    module.start_prefetch(*padded_batch)
    np.testing.assert_array_equal(bits(module(*padded_batch)), bits(want))


def test_both_call_shapes_give_the_same_rows():
    """vLLM 0.33's ``(input_ids, query_start_loc, ngram_context)`` and the seed's four
    arguments, positional or by name, for ``forward`` and ``start_prefetch`` alike."""
    config = small_config()
    module, _, _ = loaded_module(config, 1, "bfloat16", placement="pinned")
    batch = packed(config, [[1, 2, 3, 4], [3, 5]], [[0, 3], [7, 8]])
    names = dict(zip(("input_ids", "query_start_loc", "ngram_context"), batch, strict=True))
    hidden_states = torch.zeros(len(batch[0]), 4, dtype=torch.bfloat16)
    want = module(hidden_states, *batch)
    for prefetch in ((*batch,), (hidden_states, *batch), (None, *batch)):
        module.start_prefetch(*prefetch)
        np.testing.assert_array_equal(bits(module(*batch)), bits(want))
    module.start_prefetch(**names)
    np.testing.assert_array_equal(bits(module(hidden_states=hidden_states, **names)), bits(want))
    module.start_prefetch(hidden_states, **names)
    np.testing.assert_array_equal(bits(module(batch[0], **dict(list(names.items())[1:]))),
                                  bits(want))


def test_help_shows_the_three_argument_shape():
    """``forward`` and ``start_prefetch`` have vLLM 0.33's signature (the seed's four-argument
    form is an adapter around it): ``help`` and ``inspect`` show ``input_ids`` and the rest."""
    for method in (NGramEmbeddingModule.forward, NGramEmbeddingModule.start_prefetch):
        names = list(inspect.signature(method).parameters)
        assert names == ["self", "input_ids", "query_start_loc", "ngram_context"], method
        assert "input_ids" in pydoc.render_doc(method, renderer=pydoc.plaintext)


def test_call_shapes_that_fit_neither_form_are_type_errors():
    config = small_config()
    module = NGramEmbeddingModule(config, 1, placement="cpu", weight_dtype="bfloat16")
    input_ids, starts, context = packed(config, [[1, 2, 3]], [[0, 3]])
    hidden = torch.zeros(3, 4)
    cases = [
        ((hidden, starts, context), {}, "input_ids must be an integer tensor, got a "
                                        "torch.float32 tensor (hidden_states goes first"),
        ((input_ids, input_ids, starts, context), {}, "hidden_states, the first of four "
                                                      "arguments, must be a floating tensor"),
        ((hidden, input_ids, starts, context, context), {}, "got 5 positional arguments"),
        ((input_ids, starts), {}, "missing ngram_context"),
        ((input_ids, starts), {"context": context}, "unexpected or repeated argument 'context'"),
        ((input_ids, starts, context), {"input_ids": input_ids}, "repeated argument "
                                                                 "'input_ids'"),
        ((input_ids, starts, [[0, 3]]), {}, "ngram_context must be an integer tensor, got list"),
    ]
    for method in (module.forward, module.start_prefetch):
        for args, kwargs, message in cases:
            with pytest.raises(TypeError, match=re.escape(message)):
                method(*args, **kwargs)


@pytest.mark.parametrize("dtype_name", DTYPES)
@SETTINGS
@given(data=st.data())
def test_stored_rows_dequantized_equal_the_lookup(dtype_name, data):
    """``return_stored_rows``: the table's values as stored (float8 unscaled; NaNs stay NaN),
    and ``dequantize`` of them is the module's own lookup, bit for bit, to bf16 and fp16."""
    config, layer = data.draw(configs())
    batch = packed(config, *data.draw(sequences(config)))
    seed = data.draw(st.integers(0, 9))
    module, weight, _ = loaded_module(config, layer, dtype_name, seed)
    stored, _, _ = loaded_module(config, layer, dtype_name, seed, return_stored_rows=True)
    rows = stored(*batch)
    assert rows.dtype == getattr(torch, dtype_name) and rows.shape == module(*batch).shape
    layout = nc.layer_layout(config, layer)
    ids = reference.compute_ngram_ids(layout, *(t.numpy() for t in batch))
    as_stored = weight[ids].reshape(len(ids), layout.num_heads * layout.head_dim)
    nan = np.isnan(as_stored.astype(np.float32))
    assert np.isnan(rows.float().numpy()[nan]).all()
    np.testing.assert_array_equal(bits(rows)[~nan], bits(as_torch(as_stored))[~nan])
    for dtype in (torch.bfloat16, torch.float16):
        want = module.table.lookup(torch.from_numpy(ids), out_dtype=dtype)
        got = stored.ngram_embedding.dequantize(rows, dtype)
        assert got.dtype == dtype
        np.testing.assert_array_equal(bits(got), bits(want))
    np.testing.assert_array_equal(bits(stored.dequantize(rows, module.out_dtype)),
                                  bits(module(*batch)))


def test_dequantize_of_every_float8_code():
    """All 256 float8 codes, a scale that is no bfloat16 value, rows in ``[T, H, head_dim]``."""
    config = small_config(embedding_dim=16, heads_per_ngram=1, ngram_size=3)
    layout = nc.layer_layout(config, 0)
    codes = np.arange(layout.padded_rows * 8, dtype=np.uint64) % 256
    weight = codes.astype(np.uint8).view(ml_dtypes.float8_e4m3fn).reshape(-1, 8)
    module = NGramEmbeddingModule(config, 0, placement="cpu", weight_dtype="fp8",
                                  return_stored_rows=True)
    module.load_weights([("ngram_embedding.weight", as_torch(weight)),
                         ("ngram_embedding.weight_scale", torch.tensor(1.3883328))])
    assert layout.padded_rows >= 32  # every code in rows 0..31
    rows = as_torch(weight[:32]).reshape(16, 2, 8)
    ids = torch.arange(32).reshape(16, 2)
    for dtype in (torch.bfloat16, torch.float16):
        want = module.table.lookup(ids, out_dtype=dtype).reshape(16, 2, 8)
        np.testing.assert_array_equal(bits(module.dequantize(rows, dtype)), bits(want))


def test_dequantize_refuses_what_it_cannot_decode():
    module = NGramEmbeddingModule(small_config(), 0, placement="cpu", weight_dtype="fp8",
                                  return_stored_rows=True)
    rows = torch.zeros(3, 12, dtype=torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="dtype must be float32, float16 or bfloat16"):
        module.dequantize(rows, torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="stored rows .*torch.float8_e4m3fn.* got torch.float16"):
        module.dequantize(rows.to(torch.float16), torch.bfloat16)
    with pytest.raises(ValueError, match="whole rows of head_dim=3"):
        module.dequantize(rows[:, :4], torch.bfloat16)
    with pytest.raises(TypeError, match="rows must be a torch.Tensor"):
        module.dequantize(np.zeros((3, 12), np.uint8), torch.bfloat16)
    decoded = torch.ones(3, 12, dtype=torch.bfloat16)  # a default module's output: cast
    assert module.dequantize(decoded, torch.float16).dtype == torch.float16
    assert "return_stored_rows=True" in repr(module)


def test_keep_staging_keeps_the_captured_sizes_buffers():
    """Batch sizes given to ``keep_staging`` keep their prefetch staging buffers (a CUDA graph
    holds their addresses) however many other sizes come; others are dropped."""
    config = small_config()
    module, _, _ = loaded_module(config, 1, "float32", placement="pinned")
    module.keep_staging([3])
    width = config.embedding_dim
    buffers = module.table.prefetcher.buffers(HOST)
    kept = buffers.get("rows", (3, width), np.float32)
    other = buffers.get("rows", (4, width), np.float32)
    for size in range(5, 5 + 2 * STAGING_SHAPES):
        batch = packed(config, [[1] * size], [[0, 3]])
        module.start_prefetch(*batch)
        module(*batch)
    assert buffers.get("rows", (3, width), np.float32) is kept
    assert buffers.get("rows", (4, width), np.float32) is not other


def test_load_weights_returns_the_reference_names():
    config = small_config(split_ngram_parts=3)
    layout = nc.layer_layout(config, 1)
    weight = random_rows(layout.padded_rows, layout.head_dim, "float8_e4m3fn", 1)
    module = NGramEmbeddingModule(config, 1, placement="cpu", weight_dtype=torch.float8_e4m3fn)
    assert module.missing_shards == [0, 1, 2, "ngram_embedding.weight_scale"]
    loaded = module.load_weights(checkpoint_weights(config, 1, weight, 0.375))
    assert loaded == {*BUFFER_NAMES, "ngram_embedding.weight", "ngram_embedding.weight_scale"}
    assert module.missing_shards == []
    assert module.table.scale == np.float32(0.375)
    assert module.ngram_embedding.weight_scale.item() == 0.375
    np.testing.assert_array_equal(bits(module.ngram_embedding.weight), weight.view(np.uint8))


def test_streams_a_safetensors_checkpoint_as_the_library_loads_it(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    config = small_config(split_ngram_parts=5)
    layout = nc.layer_layout(config, 1)
    weight = random_rows(layout.padded_rows, layout.head_dim, "float8_e4m3fn", 7)
    prefix = "model.layers.1.ple.ple_embedding."
    path = tmp_path / "model.safetensors"
    save_file({prefix + name: value.contiguous()
               for name, value in checkpoint_weights(config, 1, weight, 0.375)}, path)
    module = NGramEmbeddingModule(config, 1, placement="cpu", weight_dtype=torch.float8_e4m3fn)
    with safe_open(path, "pt") as checkpoint:
        module.load_weights((name.removeprefix(prefix), checkpoint.get_tensor(name))
                            for name in checkpoint.keys())
    assert module.missing_shards == []
    library = nc.load_ngram_embedding(path, config, 1, prefix=prefix[:-1])
    batch = packed(config, [[1, 2, 3, 4, 3, 9], [], [3, 5]], [[0, 3], [7, 8], [3, 3]])
    want = library(*(t.numpy() for t in batch))
    np.testing.assert_array_equal(bits(module(None, *batch)), want.view(np.int16))


def test_load_weights_takes_the_whole_table():
    config = small_config()
    layout = nc.layer_layout(config, 0)
    weight = random_rows(layout.padded_rows, layout.head_dim, "float32", 2)
    module = NGramEmbeddingModule(config, 0, placement="cpu", weight_dtype="float32")
    assert module.load_weights([("ngram_embedding.weight", as_torch(weight))]) == {
        "ngram_embedding.weight"}
    assert module.missing_shards == []
    np.testing.assert_array_equal(module.ngram_embedding.weight.numpy(), weight)


def bad_weights():
    """``(entry, error type, message fragment)`` for entries load_weights must refuse."""
    config = small_config()
    layout = nc.layer_layout(config, 0)
    multipliers = torch.tensor(layout.multipliers)
    wrong = multipliers.clone()
    wrong[1] += 2
    shard_rows = split_rows(layout.padded_rows, 4, 0)[1]
    shard = torch.zeros(shard_rows, layout.head_dim, dtype=torch.bfloat16)
    return [
        (("layer_multipliers", multipliers[:2]), ValueError, "shape (2,)"),
        (("ngram_heads_offsets", torch.zeros(4, 1, dtype=torch.int64)), ValueError, "shape"),
        (("layer_multipliers", wrong), ValueError,
         f"first at index 1: got {int(wrong[1])}, the layout derives {int(multipliers[1])}"),
        (("layer_multipliers", multipliers.double()), ValueError, "integer"),
        (("ngram_embedding.shard_4.weight", shard), ValueError, "split_ngram_parts=4"),
        (("ngram_embedding.shard_0.weight", shard[1:]), ValueError, "shard_0.weight has shape"),
        (("ngram_embedding.shard_0.weight", shard[:, :1]), ValueError, "must be"),
        (("ngram_embedding.shard_0.weight", shard.float()), TypeError, "torch.float32"),
        (("ngram_embedding.shard_x.weight", shard), ValueError, "unexpected weight"),
        (("ngram_embedding.weight_scale", torch.tensor(0.5)), ValueError, "takes no scale"),
        (("ngram_embedding.bias", shard), ValueError, "unexpected weight"),
        (("layer_multipliers", [1, 2, 3]), TypeError, "torch.Tensor"),
    ]


@pytest.mark.parametrize("entry, error, message", bad_weights())
def test_load_weights_refuses(entry, error, message):
    module = NGramEmbeddingModule(small_config(), 0, placement="cpu", weight_dtype="bfloat16")
    before = bits(module.ngram_embedding.weight).copy()
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        module.load_weights([entry])
    np.testing.assert_array_equal(bits(module.ngram_embedding.weight), before)


def test_fp8_scale_must_be_one_float():
    module = NGramEmbeddingModule(small_config(), 0, placement="cpu", weight_dtype="fp8")
    for value in (torch.tensor([0.5, 0.5]), torch.tensor(2)):
        with pytest.raises(ValueError, match="one floating value"):
            module.load_weights([("ngram_embedding.weight_scale", value)])
    assert module.table.scale == np.float32(1.0)


@pytest.mark.parametrize("value", [0.0, -0.5, float("nan"), float("inf")])
def test_fp8_scale_must_be_finite_and_positive(value):
    """As the checkpoint loader: zero gives an all-zero table, NaN / inf NaN rows, a negative
    scale flips every sign; through load_weights and load_state_dict alike."""
    module = NGramEmbeddingModule(small_config(), 0, placement="cpu", weight_dtype="fp8")
    bad = torch.tensor(value, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="weight_scale must be a finite positive"):
        module.load_weights([("ngram_embedding.weight_scale", bad)])
    state = {**module.state_dict(), "ngram_embedding.weight_scale": bad}
    with pytest.raises(ValueError, match="weight_scale must be a finite positive"):
        module.load_state_dict(state)
    assert module.table.scale == np.float32(1.0)
    assert module.state_dict()["ngram_embedding.weight_scale"].item() == 1.0


def test_load_weights_streams_shard_by_shard(monkeypatch):
    """Each shard is written as it arrives, and no copy of the table is made meanwhile."""
    config = small_config(ngram_size=2, heads_per_ngram=2, ngram_vocab_size_base=2000,
                          embedding_dim=64, split_ngram_parts=8)
    layout = nc.layer_layout(config, 0)
    module = NGramEmbeddingModule(config, 0, placement="cpu", weight_dtype="float32")
    events = []
    write_rows = module.table.write_rows

    def spy(start, rows):
        events.append(("write", start, rows.shape[0]))
        write_rows(start, rows)

    monkeypatch.setattr(module.table, "write_rows", spy)

    def shards():
        for index in range(config.split_ngram_parts):
            start, stop = split_rows(layout.padded_rows, config.split_ngram_parts, index)
            events.append(("yield", start, stop - start))
            block = np.full((stop - start, layout.head_dim), index, dtype=np.float32)
            yield f"ngram_embedding.shard_{index}.weight", torch.from_numpy(block)

    tracemalloc.start()
    try:
        module.load_weights(shards())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    expected = []
    for index in range(config.split_ngram_parts):
        start, stop = split_rows(layout.padded_rows, config.split_ngram_parts, index)
        expected += [("yield", start, stop - start), ("write", start, stop - start)]
    assert events == expected
    shard_bytes = -(-layout.padded_rows // config.split_ngram_parts) * layout.head_dim * 4
    assert peak < 3 * shard_bytes < module.table.nbytes / 2
    first_rows = np.repeat(np.arange(8), -(-layout.padded_rows // 8))[: layout.padded_rows]
    np.testing.assert_array_equal(module.ngram_embedding.weight[:, 0].numpy(), first_rows)


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_state_dict_round_trip(dtype_name):
    config = small_config()
    source, weight, scale = loaded_module(config, 1, dtype_name, seed=3)
    state = source.state_dict()
    names = {*BUFFER_NAMES, "ngram_embedding.weight"}
    assert set(state) == (names | {"ngram_embedding.weight_scale"} if scale else names)
    np.testing.assert_array_equal(bits(state["ngram_embedding.weight"]),
                                  weight.view(DTYPES[dtype_name][1]))
    saved = io.BytesIO()
    torch.save(state, saved)
    saved.seek(0)
    target = NGramEmbeddingModule(config, 1, placement="cpu", weight_dtype=dtype_name)
    target.load_state_dict(torch.load(saved))
    assert target.missing_shards == []
    if scale is not None:
        assert target.table.scale == np.float32(scale)
    batch = packed(config, [[1, 2, 3, 4], [3, 5]], [[0, 3], [7, 8]])
    np.testing.assert_array_equal(bits(target(None, *batch)), bits(source(None, *batch)))
    for name, value in target.state_dict().items():
        np.testing.assert_array_equal(bits(value), bits(state[name]))


def test_load_state_dict_assign_still_fills_the_table():
    config = small_config()
    source, weight, _ = loaded_module(config, 0, "float8_e4m3fn", seed=6)
    state = {name: value.clone() for name, value in source.state_dict().items()}
    state["ngram_embedding.weight_scale"] = torch.tensor([0.75], dtype=torch.bfloat16)
    target = NGramEmbeddingModule(config, 0, placement="cpu", weight_dtype="float8_e4m3fn")
    target.load_state_dict(state, assign=True)
    weights = target.ngram_embedding
    assert weights.weight.data_ptr() == target.table.host_view.ctypes.data
    np.testing.assert_array_equal(target.table.host_view.view(np.uint8), weight.view(np.uint8))
    assert target.table.scale == np.float32(0.75)
    assert weights.weight_scale.dtype == torch.float32 and weights.weight_scale.shape == ()


def test_load_state_dict_checks_buffers_before_copying():
    config = small_config()
    source, _, _ = loaded_module(config, 0, "float16")
    state = source.state_dict()
    state["ngram_heads_vocab_sizes"] = state["ngram_heads_vocab_sizes"] + 1
    target = NGramEmbeddingModule(config, 0, placement="cpu", weight_dtype="float16")
    with pytest.raises(ValueError, match="ngram_heads_vocab_sizes differs .* first at index 0"):
        target.load_state_dict(state)
    layout = nc.layer_layout(config, 0)
    np.testing.assert_array_equal(target.ngram_heads_vocab_sizes.numpy(), layout.head_sizes)


def test_conversions_leave_the_table_alone():
    config = small_config()
    module, weight, scale = loaded_module(config, 0, "float8_e4m3fn", seed=4)
    batch = packed(config, [[5, 6, 7]], [[1, 2]])
    before = bits(module(None, *batch))
    module.half().double().to("cpu")
    assert module.ngram_embedding.weight.dtype == torch.float8_e4m3fn
    assert module.ngram_embedding.weight.data_ptr() == module.table.host_view.ctypes.data
    np.testing.assert_array_equal(bits(module(None, *batch)), before)


def test_default_weight_dtype_follows_the_config_then_torch():
    assert NGramEmbeddingModule(small_config(ple_embedding_dtype="float8_e4m3fn"), 0,
                                placement="cpu").ngram_embedding.weight.dtype == (
        torch.float8_e4m3fn)
    module = NGramEmbeddingModule(small_config(), 0, placement="cpu")
    assert module.ngram_embedding.weight.dtype == torch.get_default_dtype()
    assert not hasattr(module.ngram_embedding, "weight_scale")


def test_constructor_refuses_bad_arguments():
    with pytest.raises(ValueError, match="embedding_dim"):
        NGramEmbeddingModule(small_config(embedding_dim=None), 0, placement="cpu")
    with pytest.raises(ValueError, match="placement"):
        NGramEmbeddingModule(small_config(), 0, placement="tpu")
    with pytest.raises(TypeError, match="weight_dtype|dtype"):
        NGramEmbeddingModule(small_config(), 0, placement="cpu", weight_dtype=torch.int8)
    with pytest.raises(TypeError, match="NGramConfig"):
        NGramEmbeddingModule({"vocab_size": 3}, 0, placement="cpu")


def test_the_default_placement_is_the_gpu_only_where_there_is_one(monkeypatch):
    """No GPU: "cpu" and one CpuPlacementWarning per process, pointing at the caller; a GPU:
    "gpu"; "gpu" asked for without one is a ValueError naming the placement (issue 43)."""
    from ngram_cupy.tables import storage
    from ngram_cupy.torch import CpuPlacementWarning, default_placement
    from ngram_cupy.torch import placement as placement_module

    monkeypatch.setattr(placement_module, "gpu_available", lambda: False)
    monkeypatch.setattr(storage, "gpu_available", lambda: False)
    default_placement.cache_clear()
    try:
        with pytest.warns(CpuPlacementWarning, match="placement='cpu'") as warned:
            first = NGramEmbeddingModule(small_config(), 0)
            second = NGramEmbeddingModule(small_config(), 0)
        assert len(warned) == 1 and warned[0].filename == __file__
        assert first.table.placement == second.table.placement == "cpu"
        with pytest.raises(ValueError, match="placement='gpu' needs CuPy and a CUDA device"):
            NGramEmbeddingModule(small_config(), 0, placement="gpu")
        monkeypatch.setattr(placement_module, "gpu_available", lambda: True)
        default_placement.cache_clear()
        assert default_placement() == "gpu"
    finally:
        default_placement.cache_clear()


def test_to_torch_hands_bfloat16_and_float8_results_to_torch_without_a_copy():
    """DLPack cannot carry NumPy's ml_dtypes types: ``to_torch`` moves their bits (issue 43)."""
    from ngram_cupy.torch import to_torch

    ids = np.array([[1, 2], [3, 9]])
    values = np.arange(-20, 20, dtype=np.float32).reshape(10, 4) / 4
    for dtype, torch_dtype in ((ml_dtypes.bfloat16, torch.bfloat16),
                               (np.float32, torch.float32)):
        rows = nc.EmbeddingTable(values.astype(dtype)).lookup(ids)
        tensor = to_torch(rows)
        assert tensor.dtype == torch_dtype and tensor.data_ptr() == rows.ctypes.data
        np.testing.assert_array_equal(tensor.float().numpy(), rows.astype(np.float32))
    with pytest.raises(BufferError):
        torch.from_dlpack(rows.astype(ml_dtypes.bfloat16))
    stored = values.astype(ml_dtypes.float8_e4m3fn)
    assert to_torch(stored).dtype == torch.float8_e4m3fn
    np.testing.assert_array_equal(to_torch(stored).view(torch.uint8).numpy(),
                                  stored.view(np.uint8))
    assert to_torch(tensor) is not None and to_torch(tensor).data_ptr() == tensor.data_ptr()
    with pytest.raises(TypeError, match="array must be"):
        to_torch([1.0, 2.0])


@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["gpu", "pinned"])
@pytest.mark.parametrize("dtype_name", DTYPES)
def test_cuda_tensors_match_the_cpu(placement, dtype_name):
    config = small_config(split_ngram_parts=5)
    cpu, weight, scale = loaded_module(config, 2, dtype_name, seed=5)
    module, _, _ = loaded_module(config, 2, dtype_name, seed=5, placement=placement)
    batch = packed(config, [[1, 2, 3, 4, 3, 9], [], [3, 5]], [[0, 3], [7, 8], [3, 3]], 2)
    want = cpu(None, *batch)
    cuda_batch = [t.cuda() for t in batch]
    hidden_states = torch.zeros(len(batch[0]), 8, device="cuda")
    result = module(hidden_states, *cuda_batch)
    assert result.is_cuda and result.dtype == want.dtype
    np.testing.assert_array_equal(bits(result), bits(want))
    module.start_prefetch(hidden_states, *cuda_batch)
    np.testing.assert_array_equal(bits(module(hidden_states, *cuda_batch)), bits(want))
    ids = module.compute_ngram_ids(*cuda_batch)
    assert ids.is_cuda
    np.testing.assert_array_equal(ids.cpu().numpy(), cpu.compute_ngram_ids(*batch).numpy())
    state = module.state_dict()
    assert state["ngram_embedding.weight"].is_cuda == (placement == "gpu")
    restored = NGramEmbeddingModule(config, 2, placement=placement, weight_dtype=dtype_name)
    restored.load_state_dict(cpu.state_dict())
    np.testing.assert_array_equal(bits(restored(hidden_states, *cuda_batch)), bits(want))


@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["gpu", "pinned"])
def test_cuda_stored_rows_of_a_padded_batch_dequantize_to_the_cpu_rows(placement):
    """On a device, vLLM 0.33's calls: a padded batch, start_prefetch without hidden_states,
    stored float8 rows, then ``ngram_embedding.dequantize`` to bf16 and fp16."""
    config = small_config(split_ngram_parts=5)
    cpu, _, _ = loaded_module(config, 2, "float8_e4m3fn", seed=5)
    module, _, _ = loaded_module(config, 2, "float8_e4m3fn", seed=5, placement=placement,
                                 return_stored_rows=True)
    batch = packed(config, [[1, 2, 3, 4, 3, 9], [], [3, 5]], [[0, 3], [7, 8], [3, 3]], 2)
    padded_batch, appended = padded(batch, [4, 5, 3, 3])
    ids = cpu.compute_ngram_ids(*appended)
    cuda_batch = [t.cuda() for t in padded_batch]
    module.start_prefetch(*cuda_batch)
    rows = module(None, *cuda_batch)
    assert rows.is_cuda and rows.dtype == torch.float8_e4m3fn
    for dtype in (torch.bfloat16, torch.float16):
        got = module.ngram_embedding.dequantize(rows, dtype)
        assert got.is_cuda
        np.testing.assert_array_equal(bits(got), bits(cpu.table.lookup(ids, out_dtype=dtype)))


@pytest.mark.gpu
def test_cuda_graphs_of_more_batch_sizes_than_staging_shapes_replay():
    """An engine captures more batch sizes than the staging buffers kept by default: with
    ``keep_staging`` each graph's prefetch buffers stay its own, and every graph, replayed after
    all were captured, gives the CPU module's rows of its new tokens."""
    config = small_config()
    cpu, _, _ = loaded_module(config, 1, "float8_e4m3fn", seed=3)
    module, _, _ = loaded_module(config, 1, "float8_e4m3fn", seed=3, placement="pinned")
    sizes = range(1, STAGING_SHAPES + 4)
    module.keep_staging(sizes)
    context = torch.tensor([[0, 3]], device="cuda")
    graphs = []
    for size in sizes:
        tokens = torch.arange(size, device="cuda")
        starts = torch.tensor([0, size], device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: compiles and allocates outside the capture
            module.start_prefetch(tokens, starts, context)
            module(tokens, starts, context)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            module.start_prefetch(tokens, starts, context)
            out = module(tokens, starts, context)
        graphs.append((graph, tokens, starts, out))
    rng = np.random.default_rng(4)
    for graph, tokens, starts, out in graphs:
        tokens.copy_(torch.from_numpy(rng.integers(0, config.vocab_size, tokens.numel())))
        graph.replay()
        torch.cuda.synchronize()
        want = cpu(tokens.cpu(), starts.cpu(), context.cpu())
        np.testing.assert_array_equal(bits(out), bits(want))


def test_hot_rows_stay_current_through_every_load_path(dtype_name="float8_e4m3fn"):
    """A module with a hot tier looks up what the untiered one does, hot and cold ids alike,
    after load_weights, load_state_dict (in place and assign=True), new weights each time, and
    an in-place weight change followed by refresh_hot_rows."""
    config = small_config()
    layout = nc.layer_layout(config, 1)
    batch = packed(config, [[1, 2, 3, 4, 3, 9, 11], [3, 5, 6]], [[0, 3], [7, 8]])
    ids = reference.compute_ngram_ids(layout, *(t.numpy() for t in batch))
    hot = np.unique(np.concatenate([ids.ravel()[::2], [0, layout.padded_rows - 1]]))
    module = NGramEmbeddingModule(config, 1, placement="pinned", weight_dtype=dtype_name,
                                  hot_rows=hot)
    read = {"hot_rows": 0, "cold_rows": 0}

    def check(weight, scale):
        want = expected_rows(config, 1, weight, scale, *batch)
        got = bits(module(None, *batch))
        np.testing.assert_array_equal(got, want.view(got.dtype))
        for tier, count in zip(read, (np.isin(ids, hot).sum(), (~np.isin(ids, hot)).sum()),
                               strict=True):
            read[tier] += int(count)
        assert module.table.counters == read

    for seed in (1, 2):  # load_weights, then other weights
        weight = random_rows(layout.padded_rows, layout.head_dim, dtype_name, seed)
        module.load_weights(checkpoint_weights(config, 1, weight, DTYPES[dtype_name][2]))
        check(weight, DTYPES[dtype_name][2])
    for seed, assign in ((3, False), (4, True)):
        source, weight, scale = loaded_module(config, 1, dtype_name, seed=seed)
        module.load_state_dict({name: value.clone() for name, value in
                                source.state_dict().items()}, assign=assign)
        check(weight, scale)
    weight = random_rows(layout.padded_rows, layout.head_dim, dtype_name, 5)
    with torch.no_grad():
        module.ngram_embedding.weight.copy_(as_torch(weight))
    module.refresh_hot_rows()
    check(weight, scale)


@pytest.mark.gpu
def test_cuda_hot_rows_stay_current_through_load_state_dict():
    """On a device: the GPU hot tier of a pinned module, after an in-place load_state_dict,
    gives the CPU module's rows (and counts its hot reads)."""
    config = small_config()
    layout = nc.layer_layout(config, 1)
    batch = packed(config, [[1, 2, 3, 4, 3, 9, 11], [3, 5, 6]], [[0, 3], [7, 8]])
    ids = reference.compute_ngram_ids(layout, *(t.numpy() for t in batch))
    hot = np.unique(ids.ravel()[::2])
    module = NGramEmbeddingModule(config, 1, placement="pinned", weight_dtype="float8_e4m3fn",
                                  hot_rows=hot)
    assert module.table.storage.device_tier is not None
    cuda_batch = [t.cuda() for t in batch]
    for seed in (1, 2):
        cpu, _, _ = loaded_module(config, 1, "float8_e4m3fn", seed=seed)
        module.load_state_dict(cpu.state_dict())
        np.testing.assert_array_equal(bits(module(None, *cuda_batch)), bits(cpu(None, *batch)))
    assert module.table.counters["hot_rows"] == 2 * int(np.isin(ids, hot).sum())


def test_a_shared_module_moves_its_loaded_rows_into_one_segment(shm_dir):
    config = small_config()
    first, weight, scale = loaded_module(config, 0, "float8_e4m3fn", placement="shared")
    second, _, _ = loaded_module(config, 0, "float8_e4m3fn", placement="shared")
    private, _, _ = loaded_module(config, 0, "float8_e4m3fn")
    assert first.table.placement == second.table.placement == "shared"
    assert first.table.storage.segment.created and not second.table.storage.segment.created
    input_ids, starts, context = packed(config, [[5, 6, 7, 8], [9]], [[1, 2], [3, 4]])
    want = private(None, input_ids, starts, context)
    for module in (first, second):
        assert np.array_equal(bits(module(None, input_ids, starts, context)), bits(want))
        assert np.array_equal(bits(module.state_dict()["ngram_embedding.weight"]),
                              bits(as_torch(weight)))
    third = NGramEmbeddingModule(config, 0, placement="shared", weight_dtype="float8_e4m3fn")
    third.load_state_dict(private.state_dict())
    assert third.table.placement == "shared" and not third.table.storage.segment.created
    assert np.array_equal(bits(third(None, input_ids, starts, context)), bits(want))
    third.table.close()
    with pytest.raises(ValueError, match="read-only"):
        first.load_weights([("ngram_embedding.shard_0.weight",
                             as_torch(weight[: split_rows(len(weight), 4, 0)[1]]))])
    first.table.close()
    second.table.close()  # shm_dir checks that no segment is left


def test_a_shared_module_keeps_its_scale_rounding(shm_dir):
    """Moving the loaded rows into the node segment must not reset scale_rounding='float32'."""
    config = small_config(split_ngram_parts=1)
    layout = nc.layer_layout(config, 0)
    codes = np.random.default_rng(0).integers(0, 120, (layout.padded_rows, layout.head_dim),
                                              dtype=np.uint8)
    weight = torch.from_numpy(codes).view(torch.float8_e4m3fn)
    batch = packed(config, [[5, 6, 7, 8, 9]], [[1, 2]])
    results = []
    for placement in ("cpu", "shared"):
        module = NGramEmbeddingModule(config, 0, placement=placement,
                                      weight_dtype="float8_e4m3fn", scale_rounding="float32")
        module.load_weights([("ngram_embedding.weight", weight),
                             ("ngram_embedding.weight_scale", torch.tensor(1.3883328))])
        assert module.table.scale_rounding == "float32"
        results.append(bits(module(*batch)))
        module.table.close()
    np.testing.assert_array_equal(results[1], results[0])  # shm_dir: no segment left


def test_a_shared_module_refuses_load_state_dict(shm_dir):
    """load_state_dict on a shared module would copy into the node's segment, changing every
    process's rows: refused like load_weights, nothing changed."""
    config = small_config()
    first, weight, _ = loaded_module(config, 0, "bfloat16", placement="shared")
    second, _, _ = loaded_module(config, 0, "bfloat16", placement="shared")
    state = {name: value.clone() for name, value in first.state_dict().items()}
    state["ngram_embedding.weight"].zero_()
    for assign in (False, True):
        with pytest.raises(ValueError, match="read-only"):
            first.load_state_dict(state, assign=assign)
    for module in (first, second):
        assert np.array_equal(bits(module.state_dict()["ngram_embedding.weight"]),
                              bits(as_torch(weight)))
    first.table.close()
    second.table.close()  # shm_dir checks that no segment is left


# --- third hostile trial ---------------------------------------------------------------------


@pytest.mark.parametrize("scale, loads", [
    (torch.ones(2), False), (torch.tensor(2), False), (torch.tensor([[0.5]]), True)])
def test_a_misshaped_fp8_scale_in_a_state_dict(scale, loads):
    """A weight_scale torch could not copy (or an integer one) is refused before the rows
    count as loaded (it left missing_shards empty and the table at scale 1); one value in any
    shape loads, as load_weights takes it."""
    config = small_config(split_ngram_parts=2)
    source, _, _ = loaded_module(config, 0, "float8_e4m3fn")
    state = {**source.state_dict(), "ngram_embedding.weight_scale": scale}
    module = NGramEmbeddingModule(config, 0, placement="cpu", weight_dtype="float8_e4m3fn")
    if not loads:
        with pytest.raises(ValueError, match="weight_scale must hold one floating value"):
            module.load_state_dict(state)
        assert module.missing_shards == [0, 1, "ngram_embedding.weight_scale"]
        assert module.table.scale == 1.0
        return
    module.load_state_dict(state)
    assert state["ngram_embedding.weight_scale"] is scale  # the caller's dict is left alone
    assert module.missing_shards == [] and module.table.scale == np.float32(0.5)
    assert float(module.ngram_embedding.weight_scale) == 0.5


def test_silent_wrong_fp8_shards_without_their_scale_are_refused_until_it_arrives():
    """vLLM refuses a float8 table "missing its global scale"; rows at scale 1.0 are wrong."""
    config = small_config()
    layout = nc.layer_layout(config, 0)
    weight = random_rows(layout.padded_rows, layout.head_dim, "float8_e4m3fn", 5)
    module = NGramEmbeddingModule(config, 0, placement="cpu", weight_dtype="float8_e4m3fn")
    module.load_weights(checkpoint_weights(config, 0, weight, None))
    assert module.missing_shards == ["ngram_embedding.weight_scale"]
    batch = packed(config, [[1, 2, 3, 4]], [[0, 3]])
    for lookup in (module, module.start_prefetch):
        with pytest.raises(ValueError, match="missing ngram_embedding.weight_scale"):
            lookup(None, *batch)
    module.load_weights([("ngram_embedding.weight_scale", torch.tensor(0.375))])
    assert module.missing_shards == []
    want = expected_rows(config, 0, weight, 0.375, *batch)
    np.testing.assert_array_equal(bits(module(None, *batch)), want.view(np.int16))


def test_forward_after_a_partial_load_is_refused_naming_the_missing_shards():
    config = small_config()
    layout = nc.layer_layout(config, 0)
    weight = random_rows(layout.padded_rows, layout.head_dim, "bfloat16", 5)
    module = NGramEmbeddingModule(config, 0, placement="cpu", weight_dtype="bfloat16")
    batch = packed(config, [[1, 2, 3, 4]], [[0, 3]])
    module(None, *batch)  # a table never loaded is not refused (its rows are zeros)
    entries = [e for e in checkpoint_weights(config, 0, weight, None)
               if e[0] not in ("ngram_embedding.shard_1.weight", "ngram_embedding.shard_3.weight")]
    module.load_weights(entries)
    assert module.missing_shards == [1, 3]
    with pytest.raises(ValueError, match=r"layer 0 is partly loaded: missing 1, 3 "
                                         r"\(missing_shards\)"):
        module(None, *batch)
    module.allow_missing_weights = True
    assert module(None, *batch).shape == (4, layout.num_heads * layout.head_dim)


def test_vllm_leaves_out_empty_shards_and_they_are_not_missing():
    config = small_config(split_ngram_parts=15)  # 140 rows in parts of 10: shard 14 is empty
    layout = nc.layer_layout(config, 0)
    assert split_rows(layout.padded_rows, 15, 14) == (140, 140)
    weight = random_rows(layout.padded_rows, layout.head_dim, "float16", 2)
    module = NGramEmbeddingModule(config, 0, placement="cpu", weight_dtype="float16")
    module.load_weights(e for e in checkpoint_weights(config, 0, weight, None)
                        if e[0] != "ngram_embedding.shard_14.weight")
    assert module.missing_shards == []
    batch = packed(config, [[1, 2, 3, 4]], [[0, 3]])
    np.testing.assert_array_equal(bits(module(None, *batch)),
                                  bits(torch.from_numpy(expected_rows(config, 0, weight, None,
                                                                      *batch))))


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_ugly_deepcopy_and_pickle_give_an_equal_independent_layer(how):
    import copy
    import pickle

    config = small_config()
    source, weight, _ = loaded_module(config, 0, "float8_e4m3fn", seed=8)
    batch = packed(config, [[1, 2, 3, 4], [3, 5]], [[0, 3], [7, 8]])
    source.start_prefetch(None, *batch)  # a prefetcher with its lock and worker in use
    want = bits(source(None, *batch)).copy()
    twin = copy.deepcopy(source) if how == "deepcopy" else pickle.loads(pickle.dumps(source))
    np.testing.assert_array_equal(bits(twin(None, *batch)), want)
    assert twin.missing_shards == [] and twin.table.scale == source.table.scale
    assert twin.ngram_embedding.weight.data_ptr() == twin.table.host_view.ctypes.data
    twin.ngram_embedding.weight.zero_()
    np.testing.assert_array_equal(bits(source(None, *batch)), want)


def test_ugly_load_state_dict_assign_of_a_wrong_dtype_changes_nothing():
    config = small_config()
    source, weight, _ = loaded_module(config, 0, "bfloat16", seed=9)
    target, before, _ = loaded_module(config, 0, "bfloat16", seed=10)
    state = {**source.state_dict(),
             "ngram_embedding.weight": source.ngram_embedding.weight.float()}
    with pytest.raises(TypeError, match="torch.float32 but the table stores torch.bfloat16"):
        target.load_state_dict(state, assign=True)
    assert target.ngram_embedding.weight.dtype == torch.bfloat16
    assert target.ngram_embedding.weight.data_ptr() == target.table.host_view.ctypes.data
    np.testing.assert_array_equal(bits(target.ngram_embedding.weight), before.view(np.int16))


def test_ugly_meta_tensors_are_refused_by_name():
    config = small_config()
    module, _, _ = loaded_module(config, 0, "float32")
    input_ids, starts, context = packed(config, [[1, 2, 3, 4]], [[0, 3]])
    with pytest.raises(ValueError, match="input_ids is on the meta device"):
        module(None, input_ids.to("meta"), starts, context)
    with pytest.raises(ValueError, match="ngram_context is on the meta device"):
        module(None, input_ids, starts, context.to("meta"))
    rows = torch.empty(split_rows(module.layout.padded_rows, 4, 0)[1], 12, device="meta")
    with pytest.raises(ValueError, match="shard_0.weight is on the meta device"):
        module.load_weights([("ngram_embedding.shard_0.weight", rows)])
    state = {**module.state_dict(),
             "ngram_embedding.weight": module.ngram_embedding.weight.to("meta")}
    with pytest.raises(ValueError, match="ngram_embedding.weight is on the meta device"):
        module.load_state_dict(state, assign=True)
