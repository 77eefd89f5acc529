"""The overlapped pipeline in a model: the tiny Qwen4Exp trained a few steps on the sample corpus
with fused asynchronous SGD and prefetch has the bits of the synchronous run, and follows the
model trained on its own nn.Embedding tables within 1e-5 relative at every step."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pq = pytest.importorskip("pyarrow.parquet")
pytestmark = [pytest.mark.release_independent,  # the library's worker; transformers' side: training
              pytest.mark.usefixtures("one_torch_thread")]

from test_transformers import NAMES, VOCAB, tiny_model  # noqa: E402

from ngram_cupy.transformers import use_ngram_cupy  # noqa: E402

STEPS, LR = 5, 0.1
CORPUS = Path(__file__).resolve().parents[2] / "data" / "python_stdlib.parquet"


def corpus_batches() -> list[torch.Tensor]:
    """Consecutive corpus tokens (stored Qwen3.5 tokens) mapped as ``3 + token % 509``."""
    tokens = pq.read_table(CORPUS, columns=["tokens"]).column("tokens").combine_chunks()
    flat = tokens.values.to_numpy()[:STEPS * 4 * 32].astype(np.int64)
    mapped = 3 + flat % (VOCAB - 3)
    return [torch.from_numpy(part.reshape(4, 32).copy()) for part in np.split(mapped, STEPS)]


def train_with_closure(model) -> list[float]:
    """SGD on the language-model loss (the step's closure runs forward and backward)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)

    def loss_of(ids: torch.Tensor):
        def closure() -> torch.Tensor:
            optimizer.zero_grad()
            loss = model(ids, labels=ids).loss
            loss.backward()
            return loss
        return closure

    return [optimizer.step(loss_of(ids)).item() for ids in corpus_batches()]


def patched(asynchronous: bool):
    model = tiny_model()
    use_ngram_cupy(model, placement="cpu", trainable=True, optimizer="sgd", prefetch=True,
                   optimizer_options={"lr": LR, "asynchronous": asynchronous})
    return model


def rows(model) -> list[bytes]:
    for name in NAMES:
        model.get_submodule(name).trainable_rows.optimizer.synchronize()
    return [model.get_submodule(name).table.host_view.tobytes() for name in NAMES]


def test_asynchronous_training_has_the_synchronous_bits_and_follows_nn_embedding():
    overlapped, synchronous = patched(True), patched(False)
    assert all(overlapped.get_submodule(name).trainable_rows.optimizer.worker is not None
               for name in NAMES)
    losses = train_with_closure(overlapped)
    assert losses == train_with_closure(synchronous)
    assert rows(overlapped) == rows(synchronous)
    reference = train_with_closure(tiny_model())
    np.testing.assert_allclose(losses, reference, rtol=1e-5, atol=0)
