"""Row sharding across real processes: 2 and 3 ranks on torch.distributed (Gloo) give exactly the
unsharded lookup, tensor-parallel and data-parallel with uneven token counts; NCCL on GPUs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from gloo_ranks import TIMEOUT_S, init_method, run_ranks

import ngram_cupy as nc
from ngram_cupy.hashing.layout import split_rows

WORKER = Path(__file__).with_name("dist_worker.py")
# 4 heads of prime sizes 11..19: 60 rows padded to 64, in 5 shards of 13 (the last 12).
CONFIG = nc.NGramConfig(
    vocab_size=50, ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=11, eos_token_id=0,
    embedding_dim=16, make_ngram_vocab_size_divisible_by=8, split_ngram_parts=5,
)
LAYOUT = nc.layer_layout(CONFIG, 0)


def request_batch(rng, num_tokens: int):
    """A packed batch of two requests (``num_tokens`` tokens in all) and its ids."""
    tokens = rng.integers(0, CONFIG.vocab_size, num_tokens)
    starts = np.array([0, num_tokens // 2, num_tokens])
    context = rng.integers(0, CONFIG.vocab_size, (2, CONFIG.ngram_size - 1))
    return tokens, starts, context


def run_job(tmp_path, world: int, counts, backend="gloo", placements=("cpu", "mmap"),
              dtype=ml_dtypes.float8_e4m3fn):
    """Run ``world`` worker processes on one checkpoint: (full embedding, inputs, outputs)."""
    rng = np.random.default_rng(world)
    weight = rng.uniform(-4, 4, (LAYOUT.padded_rows, LAYOUT.head_dim)).astype(dtype)
    scale = np.array(0.75, ml_dtypes.bfloat16) if dtype == ml_dtypes.float8_e4m3fn else None
    nc.save_ngram_embedding(tmp_path / "ckpt", LAYOUT, weight, scale, num_files=2)
    full = nc.load_ngram_embedding(tmp_path / "ckpt", CONFIG, 0)
    # Ids include the first and last rows and rows of every rank.
    inputs = {"ids": np.concatenate([rng.integers(0, LAYOUT.padded_rows, (9, 4)),
                                     [[0, 63, 1, 62]]])}
    for rank, count in enumerate(counts):
        tokens, starts, context = request_batch(rng, count)
        inputs.update({f"tokens_{rank}": tokens, f"starts_{rank}": starts,
                       f"context_{rank}": context,
                       f"ids_{rank}": rng.integers(0, LAYOUT.padded_rows, (count, 4))})
    np.savez(tmp_path / "inputs.npz", **inputs)
    job = dict(
        config=CONFIG.__dict__, layer=0, checkpoint=str(tmp_path / "ckpt"), world_size=world,
        backend=backend, init_method=init_method(), timeout_s=TIMEOUT_S // 2,
        placements=list(placements),
    )
    (tmp_path / "job.json").write_text(json.dumps(job))
    if backend == "gloo":
        compile_for_ranks(tmp_path / "ckpt", placements, world)
    outs = run_ranks(WORKER, tmp_path, world)
    return full, inputs, outs


def compile_for_ranks(checkpoint: Path, placements, world: int) -> None:
    """Run here what the CPU ranks run, so that they load the kernels from Numba's disk cache
    instead of all compiling the same ones at once (a cold cache: seconds of CPU per rank)."""
    tokens, starts, context = np.arange(4), np.array([0, 2, 4]), np.zeros((2, 2), np.int64)
    for placement in placements:
        embedding = nc.load_ngram_embedding(checkpoint, CONFIG, 0, placement=placement,
                                            rank=world - 1, world_size=world)
        embedding.forward(tokens, starts, context)


def check_equal_to_unsharded(full, inputs, outs, placements):
    """Every rank's every result equals the unsharded lookup, bit for bit."""
    expect_etp = full.table.lookup(inputs["ids"]).astype(np.float32)
    for rank, out in enumerate(outs):
        for placement in placements:
            np.testing.assert_array_equal(out[f"etp_{placement}"], expect_etp)
            expect = full.table.lookup(inputs[f"ids_{rank}"]).astype(np.float32)
            np.testing.assert_array_equal(out[f"dp_{placement}"], expect)
            np.testing.assert_array_equal(out[f"dp_counts_given_{placement}"], expect)
            forward = full.forward(inputs[f"tokens_{rank}"], inputs[f"starts_{rank}"],
                                   inputs[f"context_{rank}"])
            np.testing.assert_array_equal(out[f"forward_{placement}"], forward.astype(np.float32))


@pytest.mark.parametrize("world, counts", [(2, [7, 3]), (3, [4, 0, 9])])
def test_gloo_ranks_equal_unsharded(tmp_path, world, counts):
    full, inputs, outs = run_job(tmp_path, world, counts)
    check_equal_to_unsharded(full, inputs, outs, ("cpu", "mmap"))


@pytest.mark.gpu
@pytest.mark.parametrize("world, counts", [(1, [6]), (2, [5, 2])])
def test_nccl_ranks_equal_unsharded(tmp_path, world, counts):
    import cupy
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available() or not dist.is_nccl_available():
        pytest.skip("needs a CUDA build of PyTorch with NCCL")
    if cupy.cuda.runtime.getDeviceCount() < world:
        pytest.skip(f"NCCL with {world} ranks needs {world} GPUs (one per rank)")
    full, inputs, outs = run_job(tmp_path, world, counts, backend="nccl",
                                   placements=("gpu", "host"), dtype=ml_dtypes.bfloat16)
    check_equal_to_unsharded(full, inputs, outs, ("gpu", "host"))


def test_rank_lookups_sum_to_the_full_lookup(tmp_path):
    """In one process: each rank's table gives zeros outside its rows; the sum is exact."""
    weight = np.random.default_rng(1).normal(size=(LAYOUT.padded_rows, LAYOUT.head_dim))
    nc.save_ngram_embedding(tmp_path / "c.safetensors", LAYOUT, weight.astype(np.float32))
    ids = np.arange(LAYOUT.padded_rows).reshape(-1, 2)
    full = nc.load_ngram_embedding(tmp_path / "c.safetensors", CONFIG, 0).table.lookup(ids)
    for world in (2, 3, 8):
        parts = []
        for rank in range(world):
            table = nc.load_ngram_embedding(tmp_path / "c.safetensors", CONFIG, 0, rank=rank,
                                            world_size=world).table
            start, stop = split_rows(LAYOUT.padded_rows, world, rank)
            assert (table.row_start, table.num_rows) == (start, stop - start)
            part = table.lookup(ids)
            owned = ((ids >= start) & (ids < stop)).repeat(LAYOUT.head_dim, axis=1)
            assert not part[~owned].any()
            parts.append(part)
        np.testing.assert_array_equal(np.sum(parts, axis=0), full)


@pytest.fixture
def one_rank_group(tmp_path, monkeypatch):
    """A Gloo group of this process alone (world size 1), torn down afterwards."""
    import torch.distributed as dist

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    yield dist
    dist.destroy_process_group()


def test_one_rank_group(tmp_path, one_rank_group):
    weight = np.random.default_rng(2).normal(size=(LAYOUT.padded_rows, LAYOUT.head_dim))
    nc.save_ngram_embedding(tmp_path / "c.safetensors", LAYOUT, weight.astype(np.float16))
    embedding = nc.load_ngram_embedding(tmp_path / "c.safetensors", CONFIG, 0)
    ids = np.arange(LAYOUT.padded_rows).reshape(-1, 2)
    expect = embedding.table.lookup(ids)
    np.testing.assert_array_equal(nc.ShardedLookup(embedding).lookup(ids), expect)
    dp = nc.ShardedLookup(embedding, dp_group=one_rank_group.group.WORLD)
    np.testing.assert_array_equal(dp.lookup(ids), expect)
    assert dp.lookup(ids[:0]).shape == (0, 2 * LAYOUT.head_dim)
    np.testing.assert_array_equal(dp.lookup(ids, out_dtype=np.float32), expect)
    with pytest.raises(ValueError, match=r"num_tokens_across_dp must list 1 counts"):
        dp.lookup(ids, num_tokens_across_dp=[3])
    with pytest.raises(TypeError, match="ids must be int32 or int64"):  # not truncated to rows
        dp.lookup(ids + 0.5)


def test_table_of_another_rank_is_refused(tmp_path, one_rank_group):
    nc.save_ngram_embedding(tmp_path / "c.safetensors", LAYOUT,
                            np.zeros((LAYOUT.padded_rows, LAYOUT.head_dim), np.float32))
    half = nc.load_ngram_embedding(tmp_path / "c.safetensors", CONFIG, 0, rank=0, world_size=2)
    with pytest.raises(ValueError, match=r"must own rows \(0, 64\) .* owns \(0, 32\).*"
                                         "world_size=1"):
        nc.ShardedLookup(half)


def test_sharded_lookup_needs_a_table():
    with pytest.raises(TypeError, match="source must be an NGramEmbedding or an EmbeddingTable"):
        nc.ShardedLookup(np.zeros((4, 2), np.float32))


def test_sharded_lookup_needs_an_initialised_group(tmp_path):
    nc.save_ngram_embedding(tmp_path / "c.safetensors", LAYOUT,
                            np.zeros((LAYOUT.padded_rows, LAYOUT.head_dim), np.float32))
    embedding = nc.load_ngram_embedding(tmp_path / "c.safetensors", CONFIG, 0)
    with pytest.raises(RuntimeError, match="init_process_group"):
        nc.ShardedLookup(embedding)
