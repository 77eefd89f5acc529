"""Training through use_ngram_cupy(trainable=True): the tiny random Qwen4Exp model trained with
SGD on this library's float32 tables follows the model trained on transformers' own nn.Embedding
tables (losses and trained rows within 1e-6 relative: duplicate rows' gradients are summed in
float64 here, in float32 there, and torch's CPU SGD step is one fused multiply-add)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from test_transformers import NAMES, VOCAB, ple_tables, tiny_model  # noqa: E402

import ngram_cupy as nc  # noqa: E402
from ngram_cupy.transformers import ngram_optimizers, use_ngram_cupy  # noqa: E402

STEPS, LR = 20, 0.05


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def batches() -> list[torch.Tensor]:
    """Twenty small batches of random tokens, an n-gram repeated in each (duplicate rows)."""
    generator = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(3, VOCAB, (2, 6), generator=generator)
        ids[:, 3:5] = ids[:, 0:2]
        out.append(ids)
    return out


def train(model, optimizer) -> list[float]:
    """SGD steps on the language-model loss; the loss of each step."""
    losses = []
    for ids in batches():
        optimizer.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def reference():
    """The model trained as transformers ships it: losses and trained tables."""
    model = tiny_model()
    start = [t.detach().clone() for t in ple_tables(model)]
    losses = train(model, torch.optim.SGD(model.parameters(), lr=LR))
    return model, losses, [t.detach().numpy() for t in ple_tables(model)], start


def patched_rows(model) -> list[np.ndarray]:
    return [model.get_submodule(name).table.host_view.copy() for name in NAMES]


def check_same_training(reference, losses, model) -> None:
    _, want_losses, want_rows, start = reference
    np.testing.assert_allclose(losses, want_losses, rtol=1e-6, atol=0)
    for got, want, before in zip(patched_rows(model), want_rows, start, strict=True):
        assert not np.array_equal(want, before.numpy())  # the rows did train
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_fused_sgd_follows_nn_embedding(reference):
    model = tiny_model()
    use_ngram_cupy(model, placement="cpu", trainable=True, optimizer="sgd",
                   optimizer_options={"lr": LR})
    losses = train(model, torch.optim.SGD(model.parameters(), lr=LR))
    for name in NAMES:  # the fused step leaves no gradient on the tables
        assert model.get_submodule(name).ngram_embedding.weight.grad is None
    check_same_training(reference, losses, model)
    optimizers = ngram_optimizers(model)  # the public way to the attached optimizers
    assert list(optimizers) == NAMES
    for name, optimizer in optimizers.items():
        assert isinstance(optimizer, nc.SGD) and optimizer.steps == STEPS
        assert optimizer.table is model.get_submodule(name).table and optimizer.lr == LR


@pytest.mark.release_independent
def test_a_shared_table_trains_as_the_core_does(shm_dir):
    """placement="shared" trains (Hogwild, as the core's optimizers do): a fused SGD step moves
    the node segment's rows exactly as it moves a private table's, and torch's own optimizer
    steps the segment through the parameter's writable mapping."""
    trained = {}
    for placement in ("cpu", "shared"):
        model = tiny_model()
        use_ngram_cupy(model, placement=placement, trainable=True, optimizer="sgd",
                       optimizer_options={"lr": LR})
        layer = model.get_submodule(NAMES[0])
        try:
            assert layer.table.placement == placement
            for ids in batches()[:3]:
                (layer(ids).float() ** 2).sum().backward()
            trained[placement] = layer.table.host_view.copy()
        finally:
            for name in NAMES:
                model.get_submodule(name).table.close()
    assert not np.array_equal(trained["cpu"], tiny_model_rows())
    np.testing.assert_array_equal(trained["shared"].view(np.uint32), trained["cpu"].view(np.uint32))
    model = tiny_model()
    use_ngram_cupy(model, placement="shared", trainable=True)
    layer = model.get_submodule(NAMES[0])
    try:
        before = layer.table.host_view.copy()
        sgd = torch.optim.SGD([layer.ngram_embedding.weight], lr=LR)
        (layer(batches()[0]).float() ** 2).sum().backward()
        sgd.step()
        assert not np.array_equal(layer.table.host_view, before)
    finally:
        for name in NAMES:
            model.get_submodule(name).table.close()


def tiny_model_rows() -> np.ndarray:
    """The first table's rows of a fresh tiny model, as float32."""
    model = tiny_model()
    use_ngram_cupy(model, placement="cpu")
    return model.get_submodule(NAMES[0]).table.host_view.copy()


def test_sparse_gradients_with_torch_sgd_follow_nn_embedding(reference):
    model = tiny_model()
    use_ngram_cupy(model, trainable=True)  # "pinned": host memory without a GPU
    losses = train(model, torch.optim.SGD(model.parameters(), lr=LR))
    grad = model.get_submodule(NAMES[0]).ngram_embedding.weight.grad
    assert grad.is_sparse and ngram_optimizers(model) == {}  # none attached
    check_same_training(reference, losses, model)


def test_eval_without_grad_is_the_plain_lookup(reference):
    model = tiny_model()
    use_ngram_cupy(model, trainable=True)
    ids = batches()[0]
    with torch.no_grad():
        got = model(ids).logits
    np.testing.assert_array_equal(got.numpy(), tiny_model()(ids).logits.detach().numpy())


@pytest.mark.parametrize("kwargs, match", [
    (dict(optimizer="sgd", optimizer_options={"lr": 0.1}), "need trainable=True"),
    (dict(trainable=True, optimizer="lamb", optimizer_options={"lr": 0.1}),
     "optimizer must be one of sgd, rowwise_adagrad, adam"),
    (dict(trainable=True, optimizer="sgd"), "needs optimizer_options with lr"),
    (dict(trainable=True, weight_dtype=torch.float16), "float16 tables cannot be trained"),
])
def test_bad_training_options(kwargs, match):
    model = tiny_model()
    with pytest.raises(ValueError, match=match):
        use_ngram_cupy(model, **kwargs)
    assert type(model.get_submodule(NAMES[0])).__name__ == "Qwen4ExpTextNGramEmbedding"
