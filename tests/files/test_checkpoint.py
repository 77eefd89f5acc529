"""Checkpoints: safetensors files, the SPEC layout, verified loading, the mmap placement and the
shard / rank arithmetic, all on real files (each error test plants exactly one defect)."""

from __future__ import annotations

import dataclasses
import json
import os
import re

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

import ngram_cupy as nc
from ngram_cupy.codecs.dequant import default_output, reference_lookup, storage_format
from ngram_cupy.files import checkpoint as loader
from ngram_cupy.files.checkpoint_discovery import find_prefix, ple_prefixes
from ngram_cupy.files.checkpoint_names import default_prefix, owned_pieces, scale_key, shard_key
from ngram_cupy.files.checkpoint_reading import verify_buffers
from ngram_cupy.files.checkpoint_writing import ngram_tensors
from ngram_cupy.files.safetensors_files import (
    Checkpoint,
    checkpoint_paths,
    read_header,
    write_checkpoint,
)
from ngram_cupy.hashing.layout import split_rows

# 4 heads of prime sizes 11, 13, 17, 19: 60 rows padded to 64, cut in 6 shards of 11 (the last 9).
TINY = nc.NGramConfig(
    vocab_size=50, ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=11, eos_token_id=0,
    embedding_dim=16, make_ngram_vocab_size_divisible_by=8, split_ngram_parts=6,
)
DTYPES = {
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": ml_dtypes.bfloat16,
    "float8": ml_dtypes.float8_e4m3fn,
}
SCALE = np.array(0.375, dtype=ml_dtypes.bfloat16)
PREFIX = "model.layers.0.ple.ple_embedding"


def tiny_weight(dtype, layout=None, seed=0):
    """A random padded table for the tiny layout in ``dtype`` (fp8 values in its normal range)."""
    layout = layout or nc.layer_layout(TINY, 0)
    values = np.random.default_rng(seed).uniform(-4, 4, (layout.padded_rows, layout.head_dim))
    return values.astype(np.float32).astype(dtype)


def tiny_tensors(dtype=np.float32, layer=0, prefix=PREFIX):
    """The tiny layer's tensors, ready for a defect to be planted."""
    layout = nc.layer_layout(TINY, layer)
    scale = SCALE if dtype == ml_dtypes.float8_e4m3fn else None
    return ngram_tensors(layout, tiny_weight(dtype, layout), scale, prefix=prefix)


def write(tmp_path, tensors, name="ckpt.safetensors"):
    """Tensors written as one safetensors file (no atomic helper: the defect goes in as is)."""
    path = tmp_path / name
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(path))
    return path


# --- safetensors files ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_read_every_dtype_and_row_range(tmp_path, dtype):
    weight = tiny_weight(dtype)
    path = write(tmp_path, {"w": weight, "s": np.array(1.5, np.float32)})
    checkpoint = Checkpoint.open(path)
    info = checkpoint.info("w")
    assert info.shape == weight.shape and checkpoint.read("s") == 1.5
    for start, stop in [(0, None), (3, 17), (63, 64), (5, 5)]:
        rows = checkpoint.read("w", start, stop)
        assert rows.dtype == weight.dtype
        np.testing.assert_array_equal(rows.view(np.uint8), weight[start:stop].view(np.uint8))
    view = checkpoint.view("w")
    np.testing.assert_array_equal(view.view(np.uint8), weight.view(np.uint8))
    assert not view.flags.writeable


def test_fp8_reader_uses_the_header_offsets(tmp_path):
    """Several F8 tensors in one file: each view must start at its own data offset."""
    tensors = {f"t{i}": tiny_weight(ml_dtypes.float8_e4m3fn, seed=i)[: 5 + i] for i in range(4)}
    tensors["pad"] = np.arange(7, dtype=np.int16)  # shifts the data section
    checkpoint = Checkpoint.open(write(tmp_path, tensors))
    for name, array in tensors.items():
        assert checkpoint.info(name).end - checkpoint.info(name).begin == array.nbytes
        np.testing.assert_array_equal(checkpoint.read(name).view(np.uint8), array.view(np.uint8))


def test_truncated_file_is_rejected(tmp_path):
    path = write(tmp_path, {"w": tiny_weight(np.float32)})
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 4)
    with pytest.raises(ValueError, match="tensor w lies outside the file"):
        read_header(path)


@pytest.mark.parametrize("entry", [
    {"dtype": "F32", "shape": ["4"], "data_offsets": [0, 16]},
    {"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]},
    {"dtype": "F32", "shape": [4], "data_offsets": ["0", 16]},
    {"dtype": 7, "shape": [4], "data_offsets": [0, 16]},
])
def test_malformed_header_entry_is_rejected(tmp_path, entry):
    header = json.dumps({"w": entry}).encode()
    path = tmp_path / "bad.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + bytes(16))
    with pytest.raises(ValueError, match="malformed header entry for tensor w"):
        read_header(path)


def test_not_a_safetensors_file(tmp_path):
    path = tmp_path / "junk.safetensors"
    path.write_bytes(b"\xff" * 64)
    with pytest.raises(ValueError, match="not a safetensors file"):
        Checkpoint.open(path)


def test_tensor_in_two_files_is_rejected(tmp_path):
    a = write(tmp_path, {"w": np.zeros(3, np.float32)}, "a.safetensors")
    b = write(tmp_path, {"w": np.ones(3, np.float32)}, "b.safetensors")
    with pytest.raises(ValueError, match="tensor w appears in both"):
        Checkpoint([a, b])


def test_paths_of_folder_index_file_and_list(tmp_path):
    tensors = {f"t{i}": np.full(3, i, np.float32) for i in range(5)}
    files = write_checkpoint(tmp_path / "model", tensors, num_files=3)
    assert len(files) == 3
    index = tmp_path / "model" / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    assert sorted(weight_map) == sorted(tensors)
    assert checkpoint_paths(tmp_path / "model") == files == checkpoint_paths(index)
    assert checkpoint_paths(files[::-1]) == files[::-1]
    index.unlink()  # a folder without an index: every *.safetensors in it
    assert checkpoint_paths(tmp_path / "model") == sorted(files)
    checkpoint = Checkpoint.open(tmp_path / "model")
    for name, array in tensors.items():
        np.testing.assert_array_equal(checkpoint.read(name), array)


def test_index_naming_a_missing_file(tmp_path):
    files = write_checkpoint(tmp_path, {"a": np.zeros(2), "b": np.ones(2)}, num_files=2)
    os.remove(files[1])
    with pytest.raises(FileNotFoundError, match=os.path.basename(files[1])):
        checkpoint_paths(tmp_path)


def test_missing_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing-here.safetensors"):
        checkpoint_paths(tmp_path / "nothing-here.safetensors")
    with pytest.raises(ValueError, match="empty list"):
        checkpoint_paths([])


def test_write_is_atomic(tmp_path):
    path = tmp_path / "one.safetensors"
    write_checkpoint(path, {"w": np.arange(4, dtype=np.float32)})
    before = path.read_bytes()
    with pytest.raises(Exception):  # noqa: B017 -- safetensors' own error type for object arrays
        write_checkpoint(path, {"w": np.array([object()] * 4)})
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one.safetensors"]


def test_written_files_get_the_usual_permissions(tmp_path):
    """Files are as readable as any new file (the umask's), not the 0600 of a temporary file."""
    umask = os.umask(0o022)
    try:
        files = write_checkpoint(tmp_path / "m", {"a": np.zeros(2), "b": np.ones(2)}, 2)
        files += write_checkpoint(tmp_path / "one.safetensors", {"a": np.zeros(2)})
    finally:
        os.umask(umask)
    for path in [*files, tmp_path / "m" / "model.safetensors.index.json"]:
        assert os.stat(path).st_mode & 0o777 == 0o644, path


# --- shard and rank arithmetic ----------------------------------------------------------------

RELEASED_ROWS, RELEASED_PARTS = 320_001_536, 128


def test_released_layout_rows(released_config):
    assert nc.layer_layout(released_config, 0).padded_rows == RELEASED_ROWS


def test_released_shards():
    shards = [split_rows(RELEASED_ROWS, RELEASED_PARTS, i) for i in range(RELEASED_PARTS)]
    assert shards[0] == (0, 2_500_012) and shards[-1] == (317_501_524, RELEASED_ROWS)
    assert {stop - start for start, stop in shards} == {2_500_012}  # 128 divides the rows
    assert all(a[1] == b[0] for a, b in zip(shards[:-1], shards[1:], strict=True))


@pytest.mark.parametrize(
    "world, expected",
    [
        (2, [(0, 160_000_768), (160_000_768, 320_001_536)]),
        (3, [(0, 106_667_179), (106_667_179, 213_334_358), (213_334_358, 320_001_536)]),
        (8, [(i * 40_000_192, (i + 1) * 40_000_192) for i in range(8)]),
    ],
)
def test_released_rank_slices(world, expected):
    assert [split_rows(RELEASED_ROWS, world, r) for r in range(world)] == expected


def test_released_rank_reads_only_its_shards():
    # Rank 1 of 3 starts inside shard 42 and ends inside shard 85.
    pieces = owned_pieces(RELEASED_ROWS, RELEASED_PARTS, 106_667_179, 213_334_358)
    assert [p[0] for p in pieces] == list(range(42, 86))
    assert pieces[0] == (42, 105_000_504, 106_667_179, 107_500_516)
    assert pieces[-1] == (85, 212_501_020, 212_501_020, 213_334_358)
    assert sum(hi - lo for _, _, lo, hi in pieces) == 106_667_179


def test_uneven_split_leaves_empty_tail_shards():
    # ceil(10 / 8) = 2 rows per shard: shards 5, 6, 7 are empty, as in the reference loader.
    assert [split_rows(10, 8, i) for i in range(8)] == [
        (0, 2), (2, 4), (4, 6), (6, 8), (8, 10), (10, 10), (10, 10), (10, 10)
    ]
    assert owned_pieces(10, 8, 3, 10) == [
        (1, 2, 3, 4), (2, 4, 4, 6), (3, 6, 6, 8), (4, 8, 8, 10)
    ]


@pytest.mark.parametrize("args", [(10, 0, 0), (10, 3, 3), (-1, 2, 0), (10, 2, -1)])
def test_split_rows_rejects_bad_arguments(args):
    with pytest.raises(ValueError):
        split_rows(*args)


# --- prefixes ---------------------------------------------------------------------------------


def _names(*layers):
    return [f"model.layers.{i}.ple.ple_embedding.layer_multipliers" for i in layers] + [
        f"model.layers.{i}.mlp.up_proj.weight" for i in range(12)
    ]


def test_prefix_in_decoder_order_not_text_order():
    names = _names(10, 2, 9)
    assert ple_prefixes(names) == [f"model.layers.{i}.ple.ple_embedding" for i in (2, 9, 10)]
    assert find_prefix(names, TINY, 2) == "model.layers.10.ple.ple_embedding"


def test_prefix_through_ple_layer_ids():
    """ple_layer_ids count decoder layers from 1 (transformers, vLLM); module names from 0."""
    config = nc.NGramConfig(**{**TINY.__dict__, "ple_layer_ids": (3, 10, 11)})
    assert find_prefix(_names(10, 2, 9), config, 1) == "model.layers.9.ple.ple_embedding"
    assert default_prefix(nc.layer_layout(config, 2)) == "model.layers.10.ple.ple_embedding"


def test_prefix_single_layer_without_number():
    assert find_prefix(["ple.layer_multipliers"], TINY, 0) == "ple"


@pytest.mark.parametrize(
    "names, layer, ids, match",
    [
        (_names(), 0, None, "no PLE tensors"),
        (_names(1, 5), 2, None, "none matches; found model.layers.1.ple.ple_embedding, "
         "model.layers.5.ple.ple_embedding"),
        (_names(3) + ["mtp.layers.3.ple.layer_multipliers"], 0, None, "several match"),
        (_names(3, 4), 0, (7, 8), r"decoder module 6 \(ple_layer_ids\[0\] = 7, counted from 1\):"
         " none matches"),
        (_names(3), 1, (3,), "past ple_layer_ids"),
    ],
)
def test_prefix_errors_list_what_was_found(names, layer, ids, match):
    config = nc.NGramConfig(**{**TINY.__dict__, "ple_layer_ids": ids})
    with pytest.raises(ValueError, match=match):
        find_prefix(names, config, layer)


# --- loading: round trips ---------------------------------------------------------------------

PLACEMENTS = ("cpu", "host", "mmap")
ALL_IDS = np.arange(64).reshape(-1, 4)  # every row of the tiny table


def expected_lookup(weight, ids, scale=None, out_dtype=None):
    """The plain NumPy lookup every placement must reproduce."""
    fmt = storage_format(weight.dtype)
    out_dtype = default_output(fmt).dtype if out_dtype is None else out_dtype
    return reference_lookup(weight, ids, 1.0 if scale is None else float(scale), out_dtype)


def assert_same_bits(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_round_trip(tmp_path, dtype, placement):
    layout = nc.layer_layout(TINY, 0)
    weight = tiny_weight(dtype)
    scale = SCALE if dtype == ml_dtypes.float8_e4m3fn else None
    files = nc.save_ngram_embedding(tmp_path / "model", layout, weight, scale, num_files=3)
    assert len(files) == 3
    embedding = nc.load_ngram_embedding(tmp_path / "model", TINY, 0, placement=placement)
    assert embedding.layout is layout and embedding.table.total_rows == layout.padded_rows
    assert_same_bits(embedding.table.lookup(ALL_IDS), expected_lookup(weight, ALL_IDS, scale))
    assert_same_bits(
        embedding.table.lookup(ALL_IDS, out_dtype=np.float32),
        expected_lookup(weight, ALL_IDS, scale, np.float32),
    )
    tokens, starts = np.array([3, 7, 0, 9, 9, 41]), np.array([0, 4, 6])
    context = np.array([[5, 6], [0, 0]])
    ids = nc.compute_ngram_ids(layout, tokens, starts, context)
    assert_same_bits(
        embedding.forward(tokens, starts, context), expected_lookup(weight, ids, scale)
    )


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_rank_slices_load_only_their_rows(tmp_path, monkeypatch, placement):
    layout = nc.layer_layout(TINY, 0)
    weight = tiny_weight(np.float16)
    nc.save_ngram_embedding(tmp_path / "one.safetensors", layout, weight)
    read = []
    monkeypatch.setattr(Checkpoint, "read", _recording(Checkpoint.read, read))
    monkeypatch.setattr(Checkpoint, "view", _recording(Checkpoint.view, read))
    parts = []
    for rank in range(3):  # rows [0, 22), [22, 44), [44, 64); shards of 11 rows
        read.clear()
        table = nc.load_ngram_embedding(tmp_path / "one.safetensors", TINY, 0,
                                        placement=placement, rank=rank, world_size=3).table
        shards = sorted({name for name in read if "shard_" in name})
        assert shards == [shard_key(PREFIX, i) for i in ((0, 1), (2, 3), (4, 5))[rank]]
        parts.append(table.lookup(ALL_IDS, out_dtype=np.float32))
    assert_same_bits(np.sum(parts, axis=0), expected_lookup(weight, ALL_IDS, None, np.float32))


def _recording(method, log):
    """``method`` that also appends the tensor name it is asked for to ``log``."""
    def spy(self, name, *args):
        log.append(name)
        return method(self, name, *args)

    return spy


def test_mmap_serves_rows_from_the_file(tmp_path):
    """Rows come from the mapping: a byte changed in the file shows up in the next lookup (here
    the write keeps the file's modification time, which the guard checks; see below)."""
    layout = nc.layer_layout(TINY, 0)
    weight = tiny_weight(np.float32)
    path = tmp_path / "one.safetensors"
    nc.save_ngram_embedding(path, layout, weight)
    table = nc.load_ngram_embedding(path, TINY, 0, placement="mmap").table
    loaded = nc.load_ngram_embedding(path, TINY, 0).table
    info = Checkpoint.open(path).info(shard_key(PREFIX, 2))
    before = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(info.begin)  # row 22 = first row of shard 2
        f.write(np.full(4, 7.0, np.float32).tobytes())
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    ids = np.array([[22, 21, 23, 22]])
    assert table.lookup(ids)[0, :4].tolist() == [7.0] * 4
    assert_same_bits(table.lookup(ids)[:, 4:12], loaded.lookup(ids)[:, 4:12])
    assert loaded.lookup(ids)[0, :4].tolist() == weight[22].tolist()


def test_mmap_prefetch_then_lookup(tmp_path):
    """A lookup after a prefetch re-reads only the changed heads, and is still exact."""
    layout = nc.layer_layout(TINY, 0)
    weight = tiny_weight(ml_dtypes.float8_e4m3fn)
    nc.save_ngram_embedding(tmp_path / "m", layout, weight, SCALE, num_files=2)
    table = nc.load_ngram_embedding(tmp_path / "m", TINY, 0, placement="mmap").table
    changed = ALL_IDS.copy()
    changed[::3, 1] = (changed[::3, 1] + 17) % 64
    for prefetched, asked in [(ALL_IDS, ALL_IDS), (ALL_IDS, changed), (changed, ALL_IDS[:5])]:
        table.prefetch(prefetched)
        assert_same_bits(table.lookup(asked), expected_lookup(weight, asked, SCALE))
    table.close()


def test_save_torch_tensors(tmp_path):
    """torch bfloat16 / float8 weights and a bf16 scale (NumPy cannot import them) save as is."""
    torch = pytest.importorskip("torch")
    layout = nc.layer_layout(TINY, 0)
    for dtype, torch_dtype, scale in [
        (ml_dtypes.bfloat16, torch.bfloat16, None),
        (ml_dtypes.float8_e4m3fn, torch.float8_e4m3fn, torch.tensor(0.375, dtype=torch.bfloat16)),
    ]:
        weight = tiny_weight(dtype)
        raw = torch.from_numpy(weight.view(np.int8 if dtype == ml_dtypes.float8_e4m3fn
                                           else np.int16))
        path = tmp_path / f"{np.dtype(dtype).name}.safetensors"
        nc.save_ngram_embedding(path, layout, raw.view(torch_dtype), scale)
        table = nc.load_ngram_embedding(path, TINY, 0).table
        assert table.dtype == np.dtype(dtype)
        assert_same_bits(table.lookup(ALL_IDS),
                         expected_lookup(weight, ALL_IDS, None if scale is None else SCALE))


def test_two_layers_in_one_checkpoint(tmp_path):
    weights = {layer: tiny_weight(ml_dtypes.bfloat16, nc.layer_layout(TINY, layer), layer)
               for layer in (0, 1)}
    tensors = {}
    for layer, decoder_layer in ((0, 3), (1, 11)):
        tensors.update(ngram_tensors(nc.layer_layout(TINY, layer), weights[layer],
                                        prefix=f"model.layers.{decoder_layer}.ple.ple_embedding"))
    write_checkpoint(tmp_path / "model", tensors, num_files=2)
    for layer in (0, 1):
        table = nc.load_ngram_embedding(tmp_path / "model", TINY, layer).table
        ids = np.arange(table.total_rows).reshape(-1, 1)
        assert_same_bits(table.lookup(ids), expected_lookup(weights[layer], ids))


def test_progress_bar_only_when_asked_or_on_a_terminal(tmp_path, capsys):
    nc.save_ngram_embedding(tmp_path / "one.safetensors", nc.layer_layout(TINY, 0),
                            tiny_weight(np.float32))
    nc.load_ngram_embedding(tmp_path / "one.safetensors", TINY, 0)
    assert capsys.readouterr().err == ""
    nc.load_ngram_embedding(tmp_path / "one.safetensors", TINY, 0, progress=True)
    assert f"loading {PREFIX}" in capsys.readouterr().err


# --- loading: every error, one defect planted per file ----------------------------------------


def _load(tmp_path, tensors, config=TINY, **kwargs):
    return nc.load_ngram_embedding(write(tmp_path, tensors), config, 0, **kwargs)


def _buffer(name):
    return f"{PREFIX}.{name}"


def test_wrong_multiplier_value(tmp_path):
    tensors = tiny_tensors()
    good = int(tensors[_buffer("layer_multipliers")][1])
    tensors[_buffer("layer_multipliers")][1] += 2
    match = (rf"layer_multipliers differs .* first at index 1: checkpoint has {good + 2}, "
             rf"layout derives {good}")
    with pytest.raises(ValueError, match=match):
        _load(tmp_path, tensors)


def test_wrong_head_size_value(tmp_path):
    tensors = tiny_tensors()
    tensors[_buffer("ngram_heads_vocab_sizes")][3] = 23
    with pytest.raises(ValueError, match="ngram_heads_vocab_sizes .* index 3: checkpoint has 23, "
                                         "layout derives 19"):
        _load(tmp_path, tensors)


def test_wrong_offsets_shape(tmp_path):
    tensors = tiny_tensors()
    tensors[_buffer("ngram_heads_offsets")] = tensors[_buffer("ngram_heads_offsets")][:3]
    with pytest.raises(ValueError, match=r"ngram_heads_offsets has shape \(3,\) .* needs \(4,\)"):
        _load(tmp_path, tensors)


def test_float_buffer(tmp_path):
    tensors = tiny_tensors()
    tensors[_buffer("ngram_heads_offsets")] = tensors[_buffer("ngram_heads_offsets")] * 1.0
    with pytest.raises(ValueError, match="ngram_heads_offsets must be an integer buffer"):
        _load(tmp_path, tensors)


def test_missing_buffer(tmp_path):
    tensors = tiny_tensors()
    del tensors[_buffer("ngram_heads_vocab_sizes")]
    with pytest.raises(ValueError, match="no tensor .*ngram_heads_vocab_sizes"):
        _load(tmp_path, tensors)


def test_missing_shards_listed(tmp_path):
    tensors = tiny_tensors()
    del tensors[shard_key(PREFIX, 1)], tensors[shard_key(PREFIX, 4)]
    with pytest.raises(ValueError, match="2 of 6 table shards missing .*: indexes 1, 4$"):
        _load(tmp_path, tensors)


def test_shard_index_past_parts(tmp_path):
    tensors = tiny_tensors()
    tensors[shard_key(PREFIX, 6)] = tensors[shard_key(PREFIX, 5)]
    with pytest.raises(ValueError, match=r"shard_6\.weight: shard index 6 is at or past "
                                         r"split_ngram_parts=6"):
        _load(tmp_path, tensors)


def test_wrong_shard_shape(tmp_path):
    tensors = tiny_tensors()
    tensors[shard_key(PREFIX, 2)] = tensors[shard_key(PREFIX, 2)][:10]
    with pytest.raises(ValueError, match=r"shard_2\.weight has shape \(10, 4\) .* must be "
                                         r"\(11, 4\)"):
        _load(tmp_path, tensors)


def test_wrong_shard_dtype(tmp_path):
    tensors = tiny_tensors()
    tensors[shard_key(PREFIX, 3)] = tensors[shard_key(PREFIX, 3)].astype(np.float16)
    with pytest.raises(ValueError, match=r"shard_3\.weight has dtype F16 but .*shard_0\.weight "
                                         "has F32"):
        _load(tmp_path, tensors)


def test_unsupported_table_dtype(tmp_path):
    tensors = {name: a.astype(np.int32) if "shard_" in name else a
               for name, a in tiny_tensors().items()}
    with pytest.raises(ValueError, match=r"shard_0\.weight has dtype I32; tables are"):
        _load(tmp_path, tensors)


def test_fp8_without_scale(tmp_path):
    tensors = tiny_tensors(ml_dtypes.float8_e4m3fn)
    del tensors[scale_key(PREFIX)]
    with pytest.raises(ValueError, match=r"no tensor .*ngram_embedding\.weight_scale"):
        _load(tmp_path, tensors)


@pytest.mark.parametrize("dtype", [ml_dtypes.float8_e4m3fn, ml_dtypes.bfloat16])
@pytest.mark.parametrize("scale_dtype", [np.float32, np.uint8])
def test_per_shard_scales_of_no_format_are_refused(tmp_path, dtype, scale_dtype):
    """Per-channel scales (a ``shard_i.weight_scale`` no format of these checkpoints stores
    beside such rows) are refused, not dropped: a table without them reads other values."""
    tensors = tiny_tensors(dtype)
    for name in [name for name in tensors if name.endswith(".weight") and "shard_" in name]:
        rows = tensors[name].shape[0]
        tensors[name.removesuffix("weight") + "weight_scale"] = np.full((rows, 1), 7, scale_dtype)
    with pytest.raises(ValueError, match=r"shard_0\.weight_scale: .* tables store no per-shard "
                                         r"weight_scale"):
        _load(tmp_path, tensors)


def test_scale_on_an_unscaled_table(tmp_path):
    tensors = tiny_tensors(ml_dtypes.bfloat16)
    tensors[scale_key(PREFIX)] = SCALE
    with pytest.raises(ValueError, match="weight_scale is present but the table is BF16"):
        _load(tmp_path, tensors)


def test_scale_of_several_values(tmp_path):
    tensors = tiny_tensors(ml_dtypes.float8_e4m3fn)
    tensors[scale_key(PREFIX)] = np.ones(2, ml_dtypes.bfloat16)
    with pytest.raises(ValueError, match=r"weight_scale must hold one float .* shape \(2,\)"):
        _load(tmp_path, tensors)


def test_hashstats_and_token_lookup_ignored(tmp_path):
    tensors = tiny_tensors()
    tensors[f"{PREFIX}.hashstats_counts"] = np.zeros((3, 5), np.int32)
    tensors[f"{PREFIX}.ngram_embedding.hashstats_hits"] = np.zeros(7, np.int64)
    tensors[f"{PREFIX}.token_lookup"] = np.zeros((2, 2), np.float32)
    table = _load(tmp_path, tensors).table
    weight = np.concatenate([tensors[shard_key(PREFIX, i)] for i in range(6)])
    assert_same_bits(table.lookup(ALL_IDS), expected_lookup(weight, ALL_IDS))


def test_config_without_embedding_dim(tmp_path):
    config = nc.NGramConfig(**{**TINY.__dict__, "embedding_dim": None})
    with pytest.raises(ValueError, match="no embedding_dim"):
        _load(tmp_path, tiny_tensors(), config)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(placement="tape"), "placement must be one of"),
        (dict(rank=2, world_size=2), "rank must be an integer in"),
        (dict(world_size=0), "world_size must be a positive integer"),
    ],
)
def test_bad_load_arguments(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        _load(tmp_path, tiny_tensors(), **kwargs)


@pytest.mark.parametrize(
    "weight, scale, match",
    [
        (tiny_weight(np.float32)[:-1], None, "weight must have shape"),
        (tiny_weight(np.float64), None, "weight must be float32"),
        (tiny_weight(ml_dtypes.float8_e4m3fn), None, "scale is required"),
        (tiny_weight(np.float16), 0.5, "scale is only allowed"),
    ],
)
def test_save_rejects_bad_tables(tmp_path, weight, scale, match):
    with pytest.raises((ValueError, TypeError), match=match):
        nc.save_ngram_embedding(tmp_path / "x.safetensors", nc.layer_layout(TINY, 0), weight,
                                scale)
    assert not list(tmp_path.iterdir())


def test_save_needs_a_layout(tmp_path):
    with pytest.raises(TypeError, match="layout must be a LayerLayout"):
        nc.save_ngram_embedding(tmp_path / "x.safetensors", TINY, tiny_weight(np.float32))


# --- folder checkpoints replaced as a whole (issue 9) ------------------------------------------


def generation_tensors(value: float) -> dict[str, np.ndarray]:
    """Five tensors all holding ``value``: a mix of two generations shows as two values."""
    return {f"t{i}": np.full(4, value, np.float32) for i in range(5)}


def loaded_values(folder) -> set[float]:
    """Every value of every tensor of the checkpoint in ``folder``."""
    checkpoint = Checkpoint.open(folder)
    assert sorted(checkpoint.tensors) == sorted(generation_tensors(0))
    return {float(v) for name in checkpoint.tensors for v in checkpoint.read(name)}


def fail_each_call_in_turn(tmp_path, monkeypatch, primitive: str, prepare, rewrite,
                           outcome) -> set:
    """For N = 1, 2, ...: ``prepare`` a fresh folder, then ``rewrite`` it with the Nth call of
    ``os.<primitive>`` raising an I/O error, until a rewrite makes fewer than N calls (every
    call has had its turn to fail); the ``outcome`` of each folder, as a set."""
    failing_on, outcomes = 1, set()
    while True:
        folder = tmp_path / f"{primitive}{failing_on}"
        prepare(folder)
        calls, real = 0, getattr(os, primitive)

        def flaky(*args, real=real, failing_on=failing_on, **kwargs):
            nonlocal calls
            calls += 1
            if calls == failing_on:
                raise OSError(5, "injected I/O error")
            return real(*args, **kwargs)

        monkeypatch.setattr(os, primitive, flaky)
        try:
            rewrite(folder)
            failed = False
        except OSError:
            failed = True
        finally:
            monkeypatch.setattr(os, primitive, real)
        outcomes.add(outcome(folder))
        if not failed and calls < failing_on:
            return outcomes
        failing_on += 1


@pytest.mark.parametrize("primitive", ["replace", "remove", "unlink"])
def test_data_loss_folder_rewrite_failing_on_any_call_loads_old_or_new_never_a_mix(
        tmp_path, monkeypatch, primitive):
    """An I/O error on the Nth rename (or removal), for every N: the folder loads completely as
    the old generation or the new one."""

    def outcome(folder) -> float:
        values = loaded_values(folder)
        assert values in ({1.0}, {2.0}), values
        return values.pop()

    outcomes = fail_each_call_in_turn(
        tmp_path, monkeypatch, primitive,
        lambda folder: write_checkpoint(folder, generation_tensors(1.0), num_files=3),
        lambda folder: write_checkpoint(folder, generation_tensors(2.0), num_files=3), outcome)
    assert outcomes == ({1.0, 2.0} if primitive == "replace" else {2.0})


def test_data_loss_reader_refuses_files_of_another_generation(tmp_path):
    old = write_checkpoint(tmp_path / "a", generation_tensors(1.0), num_files=3)
    new = write_checkpoint(tmp_path / "b", generation_tensors(2.0), num_files=3)
    os.replace(new[1], old[1])  # a stray shard of another write under the old name
    with pytest.raises(ValueError, match="generation"):
        Checkpoint.open(tmp_path / "a")


def test_data_loss_rewrite_leaves_one_generation_and_no_temporaries(tmp_path):
    for value in (1.0, 2.0, 3.0):
        files = write_checkpoint(tmp_path, generation_tensors(value), num_files=3)
    assert sorted(os.listdir(tmp_path)) == sorted(
        [os.path.basename(f) for f in files] + ["model.safetensors.index.json"])
    assert loaded_values(tmp_path) == {3.0}


def test_data_loss_another_models_index_is_not_replaced(tmp_path):
    write_checkpoint(tmp_path, {"model.embed.weight": np.zeros(2, np.float32)})
    index = (tmp_path / "model.safetensors.index.json").read_bytes()
    with pytest.raises(ValueError, match="model.embed.weight"):
        write_checkpoint(tmp_path, generation_tensors(1.0))
    assert (tmp_path / "model.safetensors.index.json").read_bytes() == index


KILLED_WRITER = """
import os, signal, sys
import numpy as np
from ngram_cupy.files import safetensors_files as sf
real, calls = sf.save_file, []
def save_then_die(*args, **kwargs):
    real(*args, **kwargs)
    calls.append(1)
    if len(calls) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
sf.save_file = save_then_die
sf.write_checkpoint(sys.argv[1], {f"t{i}": np.full(4, 2.0, np.float32) for i in range(5)}, 3)
"""


def test_litter_writer_killed_mid_write_old_loads_and_next_write_cleans(tmp_path):
    import subprocess
    import sys

    write_checkpoint(tmp_path, generation_tensors(1.0), num_files=3)
    before = set(os.listdir(tmp_path))
    result = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(tmp_path)])
    assert result.returncode == -9
    assert set(os.listdir(tmp_path)) > before  # the killed writer's files
    assert loaded_values(tmp_path) == {1.0}
    files = write_checkpoint(tmp_path, generation_tensors(3.0), num_files=3)
    assert sorted(os.listdir(tmp_path)) == sorted(
        [os.path.basename(f) for f in files] + ["model.safetensors.index.json"])
    assert loaded_values(tmp_path) == {3.0}


SHRINKING_FILE = """
import os, sys
import numpy as np
import ngram_cupy as nc
# 64 rows of 256 float32 values: 64 KiB, so the truncated file loses whole mapped pages.
config = nc.NGramConfig(vocab_size=50, ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=11,
                        eos_token_id=0, embedding_dim=1024, make_ngram_vocab_size_divisible_by=8,
                        split_ngram_parts=6)
path, mode = sys.argv[1], sys.argv[2]
layout = nc.layer_layout(config, 0)
nc.save_ngram_embedding(path, layout, np.ones((layout.padded_rows, 256), np.float32))
if mode == "unguarded":
    nc.files.safetensors_files.Checkpoint.check_mapped = lambda self: None
table = nc.load_ngram_embedding(path, config, 0, placement="mmap").table
ids = np.arange(64, dtype=np.int64).reshape(16, 4)
table.lookup(ids)
os.truncate(path, 100)
try:
    if mode == "prefetch":
        table.prefetch(ids)
    table.lookup(ids)
except OSError as e:
    print("OSError", e)
    sys.exit(0)
sys.exit(3)
"""


def run_shrinking(tmp_path, mode):
    """Run the script above in a child process: its exit status and output."""
    import subprocess
    import sys

    path = tmp_path / "one.safetensors"
    return subprocess.run([sys.executable, "-c", SHRINKING_FILE, str(path), mode],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("mode", ["lookup", "prefetch"])
def test_crash_mmap_file_truncated_after_loading_raises_never_sigbus(tmp_path, mode):
    result = run_shrinking(tmp_path, mode)
    assert result.returncode == 0, (result.returncode, result.stderr)  # SIGBUS would be -7
    assert "shrank" in result.stdout and "one.safetensors" in result.stdout


def test_crash_mmap_truncation_is_a_sigbus_without_the_guard(tmp_path):
    """The test above can fail: without the size check the same lookup kills the process."""
    assert run_shrinking(tmp_path, "unguarded").returncode == -7  # SIGBUS


@pytest.mark.parametrize("scale", [0.0, -0.375, float("nan"), float("inf")])
def test_silent_wrong_save_with_a_degenerate_scale_is_refused_before_writing(tmp_path, scale):
    layout = nc.layer_layout(TINY, 0)
    weight = tiny_weight(ml_dtypes.float8_e4m3fn)
    for value in (scale, np.array(scale, ml_dtypes.bfloat16)):
        with pytest.raises(ValueError, match="scale must be a finite positive number"):
            nc.save_ngram_embedding(tmp_path / "m", layout, weight, value)
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("parts", [0, -3, 2.0, 10**9])
def test_silent_wrong_save_with_bad_parts_is_refused_before_writing(tmp_path, parts):
    with pytest.raises(ValueError, match="parts must be an integer"):
        nc.save_ngram_embedding(tmp_path / "m", nc.layer_layout(TINY, 0),
                                tiny_weight(np.float32), parts=parts)
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("scale", [0.0, float("nan")])
def test_silent_wrong_checkpoint_with_a_degenerate_scale_fails_to_load(tmp_path, scale):
    tensors = tiny_tensors(ml_dtypes.float8_e4m3fn)
    tensors[scale_key(PREFIX)] = np.array(scale, ml_dtypes.bfloat16)
    with pytest.raises(ValueError, match="weight_scale must be a finite positive"):
        nc.load_ngram_embedding(write(tmp_path, tensors), TINY, 0)


def test_ugly_index_whose_weight_map_is_a_list_names_the_index(tmp_path):
    write_checkpoint(tmp_path, generation_tensors(1.0))
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": ["model-00001-of-00001.safetensors"]}))
    with pytest.raises(ValueError, match="model.safetensors.index.json.*weight_map"):
        Checkpoint.open(tmp_path)


def test_ugly_overlapping_data_offsets_name_the_file(tmp_path):
    path = write(tmp_path, {"a": np.zeros(4, np.float32), "b": np.ones(4, np.float32)})
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + length])
    header["b"]["data_offsets"] = [8, 24]  # overlaps a's [0, 16)
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + length :])
    with pytest.raises(ValueError, match="ckpt.safetensors.*overlap"):
        Checkpoint.open(path)


def test_ugly_layer_past_a_one_layer_checkpoint_names_the_layer_asked_for(tmp_path):
    path = write(tmp_path, tiny_tensors())
    with pytest.raises(ValueError, match=r"PLE layer 1: none matches; found .* \(1 PLE layer"):
        nc.load_ngram_embedding(path, TINY, 1)


def test_data_loss_reader_of_an_index_replaced_meanwhile_reads_the_new_generation(tmp_path,
                                                                                   monkeypatch):
    """A reader that read the old index just before a writer committed and removed the old
    files reads the index again and loads the new generation whole."""
    from ngram_cupy.files import safetensors_files

    write_checkpoint(tmp_path, generation_tensors(1.0), num_files=3)
    stale = safetensors_files.read_index(tmp_path / "model.safetensors.index.json")
    write_checkpoint(tmp_path, generation_tensors(2.0), num_files=3)
    real, calls = safetensors_files.read_index, []

    def first_read_is_stale(index):
        calls.append(index)
        return stale if len(calls) == 1 else real(index)

    monkeypatch.setattr(safetensors_files, "read_index", first_read_is_stale)
    assert loaded_values(tmp_path) == {2.0}
    assert len(calls) == 2


def test_save_mirrors_load_with_the_config_and_writes_config_json(tmp_path):
    """save_ngram_embedding(path, config, layer, weight, scale) is load's mirror: the folder gets
    the config's config.json (merged into a model's own), and loads back with from_hf."""
    import json

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"hidden_size": 7, "seed": 1}))
    weight = tiny_weight(ml_dtypes.float8_e4m3fn)
    nc.save_ngram_embedding(tmp_path / "m", TINY, 0, weight, SCALE, num_files=2)
    written = json.loads((tmp_path / "m" / "config.json").read_text())
    assert written["hidden_size"] == 7 and written["seed"] == TINY.seed
    config = nc.NGramConfig.from_hf(tmp_path / "m")
    assert config == TINY
    layer = nc.load_ngram_embedding(tmp_path / "m", config, 0)
    ids = np.arange(12).reshape(4, 3)
    np.testing.assert_array_equal(
        layer.table.lookup(ids).view(np.uint16),
        reference_lookup(weight, ids, float(SCALE), ml_dtypes.bfloat16).view(np.uint16))
    nc.save_ngram_embedding(tmp_path / "n", TINY, 0, tiny_weight(np.float32), write_config=False)
    assert not (tmp_path / "n" / "config.json").exists()


def test_save_refuses_what_its_config_json_could_not_load_or_would_lose(tmp_path):
    """Before writing anything: parts other than the config's split_ngram_parts with a
    config.json beside (the pair would not load), and a config.json there that is not a JSON
    object (merging would drop the model's own keys)."""
    weight = tiny_weight(ml_dtypes.float8_e4m3fn)
    with pytest.raises(ValueError, match="split_ngram_parts"):
        nc.save_ngram_embedding(tmp_path / "p", TINY, 0, weight, SCALE,
                                parts=TINY.split_ngram_parts + 1)
    assert not (tmp_path / "p").exists()
    nc.save_ngram_embedding(tmp_path / "q", TINY, 0, weight, SCALE,
                            parts=TINY.split_ngram_parts + 1, write_config=False)
    for text in ('{"hidden_size": 7,}', "[1, 2]"):
        folder = tmp_path / f"bad{len(text)}"
        folder.mkdir()
        (folder / "config.json").write_text(text)
        with pytest.raises(ValueError, match="config.json"):
            nc.save_ngram_embedding(folder, TINY, 0, weight, SCALE)
        assert (folder / "config.json").read_text() == text
        assert sorted(p.name for p in folder.iterdir()) == ["config.json"]


# --- third hostile trial: replaced files, changed mappings, dtypes, vLLM's checkpoints ------


def all_ids(layout):
    """Every row id once, as a [rows / 4, 4] batch."""
    return np.arange(layout.padded_rows, dtype=np.int64).reshape(-1, 4)


@pytest.mark.parametrize("placement", ["cpu", "mmap"])
def test_silent_wrong_checkpoint_replaced_during_load_loads_the_old_one_whole(
        tmp_path, monkeypatch, placement):
    """The library's writer replaces the file (a longer header: every offset moves) after the
    headers were read: the rows still come from the file those headers describe."""
    layout = nc.layer_layout(TINY, 0)
    old, new = tiny_weight(np.float32, seed=1), tiny_weight(np.float32, seed=2)
    path = tmp_path / "one.safetensors"
    nc.save_ngram_embedding(path, layout, old)
    verify = verify_buffers

    def verify_then_replace(checkpoint, prefix, layout):
        verify(checkpoint, prefix, layout)
        nc.save_ngram_embedding(path, layout, new, prefix="model.layers.0.a.much.longer.prefix")

    monkeypatch.setattr(loader, "verify_buffers", verify_then_replace)
    table = nc.load_ngram_embedding(path, TINY, 0, placement=placement).table
    ids = all_ids(layout)
    if placement == "mmap":  # the mapping is the old file's, and the guard sees it is gone
        assert_same_bits(table.storage.blocks[0].view(np.float32)[:4], old[:4])
        with pytest.raises(OSError, match="one.safetensors was replaced"):
            table.lookup(ids)
    else:
        assert_same_bits(table.lookup(ids), expected_lookup(old, ids))


def rewrite_in_place(path, data: bytes) -> None:
    """New contents for the same inode (no rename)."""
    with open(path, "r+b") as f:
        f.truncate(0)
        f.write(data)


@pytest.mark.parametrize("change", ["regrown", "longer header", "row rewritten", "replaced"])
def test_silent_wrong_mmap_file_changed_under_the_table_is_refused(tmp_path, change):
    layout = nc.layer_layout(TINY, 0)
    path, other = tmp_path / "one.safetensors", tmp_path / "other.safetensors"
    nc.save_ngram_embedding(path, layout, tiny_weight(np.float32, seed=1))
    table = nc.load_ngram_embedding(path, TINY, 0, placement="mmap").table
    ids = all_ids(layout)
    table.lookup(ids)
    size = path.stat().st_size
    if change == "regrown":  # truncated then regrown to the same size: zeros everywhere
        os.truncate(path, 0)
        os.truncate(path, size)
    elif change == "longer header":  # same inode, every row shifted
        nc.save_ngram_embedding(other, layout, tiny_weight(np.float32, seed=1),
                                prefix="model.layers.0.a.much.longer.prefix")
        rewrite_in_place(path, other.read_bytes())
    elif change == "row rewritten":  # same header and size, one row changed
        info = Checkpoint.open(path).info(shard_key(PREFIX, 0))
        with open(path, "r+b") as f:
            f.seek(info.begin)
            f.write(np.full(4, 7.0, np.float32).tobytes())
        os.utime(path, ns=(0, 10**18))  # a modification time the guard cannot have seen
    else:  # the library's writer, by rename
        nc.save_ngram_embedding(path, layout, tiny_weight(np.float32, seed=2))
    assert path.stat().st_size >= size  # never the shrink the size check sees
    with pytest.raises(OSError, match="one.safetensors was (written to|replaced)"):
        table.lookup(ids)
    with pytest.raises(OSError, match="one.safetensors was (written to|replaced)"):
        table.prefetch(ids)
        table.lookup(ids)


def test_silent_wrong_bf16_rows_for_a_float8_config_are_refused_naming_both(tmp_path):
    config = dataclasses.replace(TINY, ple_embedding_dtype="float8_e4m3fn")
    layout = nc.layer_layout(config, 0)
    weight = tiny_weight(ml_dtypes.bfloat16)
    path = write(tmp_path, tiny_tensors(ml_dtypes.bfloat16))
    with pytest.raises(ValueError, match="stores bfloat16 .BF16. table rows but the config's "
                                         "ple_embedding_dtype is float8_e4m3fn"):
        nc.load_ngram_embedding(path, config, 0)
    ids = all_ids(layout)
    for placement in ("cpu", "mmap"):
        stored = nc.load_ngram_embedding(path, config, 0, placement=placement,
                                         weight_dtype="stored").table
        assert stored.dtype == ml_dtypes.bfloat16
        assert_same_bits(stored.lookup(ids), expected_lookup(weight, ids))
    with pytest.raises(ValueError, match="float8 need a scale"):
        nc.load_ngram_embedding(path, config, 0, weight_dtype="float8_e4m3fn")


def test_explicit_weight_dtype_converts_unscaled_rows(tmp_path):
    weight = tiny_weight(ml_dtypes.bfloat16)
    path = write(tmp_path, tiny_tensors(ml_dtypes.bfloat16))
    table = nc.load_ngram_embedding(path, TINY, 0, weight_dtype="float32").table
    assert table.dtype == np.float32
    ids = all_ids(nc.layer_layout(TINY, 0))
    assert_same_bits(table.lookup(ids), expected_lookup(weight.astype(np.float32), ids))
    with pytest.raises(ValueError, match="mmap table serves the rows as stored"):
        nc.load_ngram_embedding(path, TINY, 0, placement="mmap", weight_dtype="float32")
    with pytest.raises(TypeError, match="weight_dtype must be one of"):
        nc.load_ngram_embedding(path, TINY, 0, weight_dtype="int4")


def test_vllm_checkpoint_without_its_empty_tail_shards_loads(tmp_path):
    """64 rows in 30 parts of ceil(64 / 30) = 3: shards 22-29 hold no rows, and vLLM's writer
    leaves them out."""
    config = dataclasses.replace(TINY, split_ngram_parts=30)
    layout = nc.layer_layout(config, 0)
    weight = tiny_weight(np.float32, layout)
    tensors = ngram_tensors(layout, weight)
    for index in range(22, 30):
        assert tensors.pop(shard_key(PREFIX, index)).shape[0] == 0
    ids = all_ids(layout)
    for placement in ("cpu", "mmap"):
        table = nc.load_ngram_embedding(write(tmp_path, tensors), config, 0,
                                        placement=placement).table
        assert_same_bits(table.lookup(ids), expected_lookup(weight, ids))
    del tensors[shard_key(PREFIX, 21)]  # 1 row: not empty, so still missing
    with pytest.raises(ValueError, match="1 of 30 table shards missing .*: indexes 21$"):
        _load(tmp_path, tensors, config)


def with_dtype_code(path, name: str, code: str) -> None:
    """Rewrite one tensor's dtype code in a safetensors header (same length: nothing moves)."""
    data = bytearray(path.read_bytes())
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    assert len(code) == len(header[name]["dtype"])
    header[name]["dtype"] = code
    raw = json.dumps(header, separators=(",", ":")).encode()
    data[8:8 + length] = raw.ljust(length)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("shard", [0, 3])
def test_ugly_unknown_safetensors_dtype_beside_the_buffers_names_the_tensor(tmp_path, shard):
    path = write(tmp_path, tiny_tensors())
    with_dtype_code(path, shard_key(PREFIX, shard), "X32")
    with pytest.raises(ValueError, match=rf"shard_{shard}\.weight has dtype X32"):
        nc.load_ngram_embedding(path, TINY, 0)


def test_mmap_table_of_a_relative_path_survives_a_change_of_working_folder(tmp_path,
                                                                          monkeypatch):
    layout = nc.layer_layout(TINY, 0)
    weight = tiny_weight(np.float32, seed=3)
    nc.save_ngram_embedding(tmp_path / "one.safetensors", layout, weight)
    monkeypatch.chdir(tmp_path)
    table = nc.load_ngram_embedding("one.safetensors", TINY, 0, placement="mmap").table
    monkeypatch.chdir(tmp_path.parent)
    ids = all_ids(layout)
    assert_same_bits(table.lookup(ids), expected_lookup(weight, ids))


def test_files_take_hugging_faces_names_unless_the_live_checkpoint_holds_them(tmp_path):
    """A fresh folder gets model-00001-of-00002.safetensors; a rewrite never reuses a name the
    live index names (crash atomicity), and the next one takes the standard names again."""
    first = write_checkpoint(tmp_path, generation_tensors(1.0), num_files=2)
    assert [os.path.basename(f) for f in first] == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    second = write_checkpoint(tmp_path, generation_tensors(2.0), num_files=2)
    assert not set(first) & set(second)
    third = write_checkpoint(tmp_path, generation_tensors(3.0), num_files=2)
    assert third == first
    assert loaded_values(tmp_path) == {3.0}


# --- several layers saved one call at a time into one folder (issue 43) -----------------------


def loads_as(folder, layer, weight, scale=None) -> bool:
    """Whether ``folder`` holds PLE layer ``layer`` with exactly ``weight``'s rows (False when
    it holds no such layer)."""
    try:
        table = nc.load_ngram_embedding(folder, TINY, layer, weight_dtype="stored").table
    except ValueError as e:
        assert "cannot tell which PLE prefix" in str(e)
        return False
    ids = np.arange(table.total_rows).reshape(-1, 1)
    assert_same_bits(table.lookup(ids), expected_lookup(weight, ids, scale))
    return True


def test_layers_saved_one_call_at_a_time_share_one_folder(tmp_path):
    """save_ngram_embedding(folder, config, 1, w1) after layer 0 adds layer 1: both load, the
    index names both layers' tensors, the files keep Hugging Face's names; saving a layer again
    replaces that layer alone (its fp8 scale gone with it)."""
    folder = tmp_path / "m"
    weights = {layer: tiny_weight(np.float32, nc.layer_layout(TINY, layer), layer)
               for layer in (0, 1)}
    nc.save_ngram_embedding(folder, TINY, 0, weights[0], num_files=2)
    files = nc.save_ngram_embedding(folder, TINY, 1, weights[1], num_files=2)
    assert all(re.fullmatch(r"model-0000\d-of-00002(-[0-9a-f]{8})?\.safetensors",
                            os.path.basename(f)) for f in files)
    config = nc.NGramConfig.from_hf(folder)
    for layer in (0, 1):
        assert loads_as(folder, layer, weights[layer])
    names = {**tiny_tensors(np.float32, 0, "model.layers.0.ple.ple_embedding"),
             **tiny_tensors(np.float32, 1, "model.layers.1.ple.ple_embedding")}
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(names)
    fp8 = tiny_weight(ml_dtypes.float8_e4m3fn, seed=7)
    nc.save_ngram_embedding(folder, config, 0, fp8, SCALE, write_config=False)
    assert loads_as(folder, 0, fp8, SCALE) and loads_as(folder, 1, weights[1])
    nc.save_ngram_embedding(folder, config, 0, weights[0])
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(names)  # the scale went with the fp8 rows
    assert loads_as(folder, 0, weights[0]) and loads_as(folder, 1, weights[1])
    assert len(os.listdir(folder)) == 3  # config.json, the index and one file: nothing stale


@pytest.mark.parametrize("primitive", ["replace", "unlink"])
def test_data_loss_adding_a_layer_failing_on_any_call_keeps_the_folder_whole(
        tmp_path, monkeypatch, primitive):
    """An I/O error on the Nth rename (or removal) while layer 1 is added, for every N: the
    folder loads layer 0 as it was, and layer 1 whole or not at all."""
    weights = {layer: tiny_weight(np.float32, nc.layer_layout(TINY, layer), layer)
               for layer in (0, 1)}

    def outcome(folder) -> bool:
        assert loads_as(folder, 0, weights[0])
        return loads_as(folder, 1, weights[1])

    outcomes = fail_each_call_in_turn(
        tmp_path, monkeypatch, primitive,
        lambda folder: nc.save_ngram_embedding(folder, TINY, 0, weights[0], num_files=2),
        lambda folder: nc.save_ngram_embedding(folder, TINY, 1, weights[1], num_files=2),
        outcome)
    assert outcomes == ({False, True} if primitive == "replace" else {True})


def test_data_loss_a_layer_is_not_added_to_another_models_folder_or_config(tmp_path):
    """A folder whose index names tensors of no PLE layer (another model's) is still refused,
    and so is a folder whose config.json holds another n-gram config than the layer's: nothing
    written either time."""
    other = tmp_path / "other"
    write_checkpoint(other, {"model.embed.weight": np.zeros(2, np.float32),
                             **tiny_tensors(np.float32, 0, PREFIX)})
    before = {p.name: p.read_bytes() for p in other.iterdir()}
    with pytest.raises(ValueError, match="model.embed.weight"):
        nc.save_ngram_embedding(other, TINY, 1, tiny_weight(np.float32, nc.layer_layout(TINY, 1)))
    assert {p.name: p.read_bytes() for p in other.iterdir()} == before
    folder = tmp_path / "m"
    nc.save_ngram_embedding(folder, TINY, 0, tiny_weight(np.float32))
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    reseeded = dataclasses.replace(TINY, seed=99)
    with pytest.raises(ValueError, match=r"seed 1234 there, 99 here"):
        nc.save_ngram_embedding(folder, reseeded, 1,
                                tiny_weight(np.float32, nc.layer_layout(reseeded, 1)))
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
