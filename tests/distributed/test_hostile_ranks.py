"""Row-sharded training under hostile input (issue 43): two real Gloo ranks agree on every
step (mixed gradient dtypes, NaN in a term another rank owns, a rank without ids, refused
dtypes and ids, terms of two ranks whose sum overflows at the owner, an unexpected error)."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from gloo_ranks import TIMEOUT_S, init_method, run_ranks

import ngram_cupy as nc
from ngram_cupy.hashing.layout import split_rows

torch = pytest.importorskip("torch")

WORKER = Path(__file__).with_name("dist_hostile_worker.py")
CONFIG = nc.NGramConfig(vocab_size=50, ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=11,
                        eos_token_id=0, embedding_dim=8, split_ngram_parts=3)
LAYOUT = nc.layer_layout(CONFIG, 0)
LR, WORLD = 0.05, 2
# Per step: mode, then the gradient dtype of each rank.
STEPS = [("dp", "f32", "bf16"),  # 0: mixed dtypes: both step, as one process
         ("dp", "f32", "f32"),  # 1: NaN in a term rank 1 owns, from rank 0: refused by both
         ("dp", "f32", "f32"),  # 2: rank 1 has no ids: both step
         ("dp", "f64", "f32"),  # 3: float64 on rank 0: refused by both
         ("dp", "f32", "f32"),  # 4: an id outside the table on rank 1: refused by both
         ("dp", "f32", "f32"),  # 5: both step
         ("tp", "f32", "f32"),  # 6: NaN in a term of rank 1's rows: refused by both
         ("tp", "f32", "f32"),  # 7: both step
         ("dp", "f32", "f32"),  # 8: finite terms from both ranks whose sum for a row of rank 1
#                                 overflows: refused by rank 1 when it has them, then by both
         ("dp", "none", "f32")]  # 9: rank 0 passes ids=None (torch's RuntimeError): refused
#                                  by both, no rank left waiting in a collective
STEPPED = {"dp": (0, 2, 5), "tp": (7,)}


def hostile_step_inputs(rng) -> dict[str, np.ndarray]:
    """Each step's ids and gradients per rank (data parallel) or shared (tensor parallel)."""
    rows, heads, dim = LAYOUT.padded_rows, LAYOUT.num_heads, LAYOUT.head_dim
    owned_by_1 = split_rows(rows, WORLD, 1)[0]
    inputs = {}
    for step, (mode, *_) in enumerate(STEPS):
        for key in ([f"{step}_{rank}" for rank in range(WORLD)] if mode == "dp" else [f"{step}"]):
            count = 0 if key == "2_1" else 5
            ids = rng.integers(0, rows, (count, heads))
            grad = rng.normal(size=(count, heads * dim)).astype(np.float32)
            if key == "0_1":  # passed as bfloat16: values it holds exactly
                grad = grad.astype(ml_dtypes.bfloat16).astype(np.float32)
            if key in ("1_0", "6"):
                ids[2, 1] = owned_by_1 + 1
                grad[2, dim + 3] = np.nan
            if key == "4_1":
                ids[1, 0] = rows
            if key in ("8_0", "8_1"):
                ids[0, 0] = owned_by_1 + 2
                grad[0, :dim] = 2e38
            inputs[f"ids_{key}"], inputs[f"grad_{key}"] = ids, grad
    return inputs


def one_process_adam(checkpoint: Path, inputs, mode: str) -> np.ndarray:
    """The rows of one process's Adam stepping on the accepted steps' whole batches."""
    table = nc.load_ngram_embedding(checkpoint, CONFIG, 0, placement="cpu").table
    optimizer = nc.Adam(table, lr=LR)
    for step in STEPPED[mode]:
        keys = [f"{step}_{rank}" for rank in range(WORLD)] if mode == "dp" else [f"{step}"]
        optimizer.step_from_output_grad(np.concatenate([inputs[f"ids_{k}"] for k in keys]),
                                        np.concatenate([inputs[f"grad_{k}"] for k in keys]))
    return table.host_view.copy()


def test_data_parallel_ranks_agree_on_every_step(tmp_path):
    rng = np.random.default_rng(43)
    checkpoint = tmp_path / "ckpt"
    nc.save_ngram_embedding(checkpoint, LAYOUT, rng.normal(
        size=(LAYOUT.padded_rows, LAYOUT.head_dim)).astype(np.float32))
    inputs = hostile_step_inputs(rng)
    np.savez(tmp_path / "inputs.npz", **inputs)
    expect = {mode: one_process_adam(checkpoint, inputs, mode) for mode in STEPPED}  # and compiles
    job = dict(config=CONFIG.__dict__, checkpoint=str(checkpoint), world_size=WORLD,
               init_method=init_method(), timeout_s=TIMEOUT_S // 2, lr=LR,
               steps=[list(step) for step in STEPS])
    (tmp_path / "job.json").write_text(json.dumps(job))
    outs = run_ranks(WORKER, tmp_path, WORLD, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
    for mode in STEPPED:
        trained = np.concatenate([out[mode] for out in outs])
        np.testing.assert_array_equal(trained.view(np.uint32), expect[mode].view(np.uint32))
    for out in outs:
        assert out["steps"].tolist() == [len(STEPPED["dp"]), len(STEPPED["tp"])]
    first, second = (out["outcomes"].tolist() for out in outs)
    assert [first[i] for i in (0, 2, 5, 7)] == [second[i] for i in (0, 2, 5, 7)] == ["ok"] * 4
    assert first[1].startswith("ValueError: grad_out holds NaN")
    assert second[1].startswith("ValueError: rank(s) [0] of the group refused this step")
    assert first[3].startswith("TypeError: grad_out must be float32, bfloat16 or float16")
    assert second[3].startswith("ValueError: rank(s) [0]")
    assert first[4].startswith("ValueError: rank(s) [1]")
    assert second[4].startswith("IndexError: ids[1, 0] = 60 is outside the table's rows [0, 60)")
    assert first[6] == second[6] and first[6].startswith("ValueError: grad_out holds NaN")
    assert first[8].startswith("ValueError: rank(s) [1]")
    assert second[8].startswith("ValueError: grad_out's terms for one row sum past")
    assert first[9].startswith("RuntimeError: Could not infer dtype of NoneType")
    assert second[9].startswith("ValueError: rank(s) [0]")
