"""NGramEmbeddingModule(trainable=True) under autograd: the backward's sparse gradient is the
float64 per-row sum of a NumPy reference, torch's optimizers update the table's own rows, and a
fused optimizer's step equals the same optimizer stepped on that gradient."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import ngram_cupy as nc
from ngram_cupy.torch import NGramEmbeddingModule, fused_optimizer

CONFIG = nc.NGramConfig(vocab_size=40, ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=11,
                        eos_token_id=0, embedding_dim=8, split_ngram_parts=2)
LAYOUT = nc.layer_layout(CONFIG, 0)


def trained_module(dtype=torch.float32, **kwargs) -> NGramEmbeddingModule:
    """A trainable layer with random rows (a fixed seed)."""
    module = NGramEmbeddingModule(CONFIG, 0, placement="cpu", weight_dtype=dtype, trainable=True,
                                  **kwargs)
    rows = torch.from_numpy(np.random.default_rng(0).normal(
        size=(LAYOUT.padded_rows, LAYOUT.head_dim)).astype(np.float32))
    module.load_weights([("ngram_embedding.weight", rows.to(dtype))])
    return module


def batch(seed=1):
    """A packed batch of two requests with a repeated n-gram (a row looked up twice or more)."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, CONFIG.vocab_size, (12,), generator=generator)
    tokens[6:9] = tokens[0:3]
    return tokens, torch.tensor([0, 5, 12]), torch.zeros((2, 2), dtype=torch.int64)


def reference_gradient(ids: np.ndarray, grad_out: np.ndarray) -> np.ndarray:
    """Dense ``[rows, D]`` gradient: each row's terms summed in float64, rounded once."""
    total = np.zeros((LAYOUT.padded_rows, LAYOUT.head_dim))
    np.add.at(total, ids.reshape(-1), grad_out.astype(np.float64).reshape(-1, LAYOUT.head_dim))
    return total.astype(np.float32)


def backward_once(module, seed=2):
    """Forward a batch, backward a random output gradient: (ids, output gradient)."""
    inputs = batch()
    out = module(*inputs)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    out.backward(grad_out.to(out.dtype))
    return module.compute_ngram_ids(*inputs).numpy(), grad_out.to(out.dtype).float().numpy()


def test_sparse_gradient_is_the_float64_row_sum():
    module = trained_module()
    ids, grad_out = backward_once(module)
    grad = module.ngram_embedding.weight.grad
    assert grad.is_sparse
    assert np.unique(ids).size < ids.size  # duplicates were summed
    np.testing.assert_array_equal(grad.to_dense().numpy(), reference_gradient(ids, grad_out))
    indices = grad.coalesce().indices()[0].numpy()
    np.testing.assert_array_equal(indices, np.unique(ids))


def test_torch_sparse_adam_updates_the_table_rows():
    module = trained_module()
    plain = torch.nn.Parameter(module.ngram_embedding.weight.detach().clone())
    adam = torch.optim.SparseAdam([module.ngram_embedding.weight], lr=0.01)
    ids, grad_out = backward_once(module)
    plain.grad = module.ngram_embedding.weight.grad.clone()
    adam.step()
    torch.optim.SparseAdam([plain], lr=0.01).step()
    rows = module.table.host_view
    np.testing.assert_array_equal(rows, plain.detach().numpy())
    changed = np.unique(ids)
    assert not np.array_equal(rows[changed], trained_module().table.host_view[changed])
    inputs = batch()
    with torch.no_grad():  # lookups read the trained rows
        np.testing.assert_array_equal(module(*inputs).numpy().reshape(-1, LAYOUT.head_dim),
                                      rows[module.compute_ngram_ids(*inputs).numpy().ravel()])


@pytest.mark.parametrize("name, make, options", [
    ("sgd", "SGD", dict(lr=0.1)),
    ("rowwise_adagrad", "RowwiseAdagrad", dict(lr=0.1)),
    ("adam", "Adam", dict(lr=0.01)),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_step_equals_the_optimizer_on_the_gradient(name, make, options, dtype):
    module = trained_module(dtype)
    optimizer = fused_optimizer(module, name, **options)
    ids, grad_out = backward_once(module)
    assert module.ngram_embedding.weight.grad is None
    other = trained_module(dtype)
    expect = getattr(nc, make)(other.table, **options)
    expect.step(nc.embedding_backward(ids, grad_out))
    np.testing.assert_array_equal(module.table.host_view.view(np.uint8),
                                  other.table.host_view.view(np.uint8))
    assert type(optimizer).__name__ == make


def test_no_grad_forward_is_the_plain_lookup():
    module = trained_module()
    plain = NGramEmbeddingModule(CONFIG, 0, placement="cpu", weight_dtype=torch.float32)
    plain.load_state_dict(module.state_dict())
    with torch.no_grad():
        np.testing.assert_array_equal(module(*batch()).numpy(), plain(*batch()).numpy())
    out = module(*batch())
    assert out.requires_grad and not plain(*batch()).requires_grad


def test_copies_and_loads_stay_trainable():
    module = trained_module()
    clone = copy.deepcopy(module)
    assert isinstance(clone.ngram_embedding.weight, torch.nn.Parameter)
    np.testing.assert_array_equal(clone.table.host_view, module.table.host_view)
    fresh = NGramEmbeddingModule(CONFIG, 0, placement="cpu", weight_dtype=torch.float32,
                                 trainable=True)
    fresh.load_state_dict(module.state_dict(), assign=True)
    weight = fresh.ngram_embedding.weight
    assert isinstance(weight, torch.nn.Parameter)
    assert weight.data_ptr() == torch.from_numpy(fresh.table.host_view).data_ptr()
    backward_once(fresh)
    assert fresh.ngram_embedding.weight.grad is not None


@pytest.mark.parametrize("kwargs, match", [
    (dict(weight_dtype=torch.float16), "float16 tables cannot be trained"),
    (dict(weight_dtype="float8_e4m3fn"), "float8_e4m3fn tables cannot be trained"),
    (dict(return_stored_rows=True), "trainable=True needs return_stored_rows=False"),
])
def test_untrainable_layers_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        NGramEmbeddingModule(CONFIG, 0, **{"placement": "cpu", **kwargs, "trainable": True})


@pytest.mark.parametrize("made", ["before loading", "after loading"])
def test_a_shared_layer_trains_as_the_core_does(shm_dir, made):
    """placement="shared" trains (Hogwild, as the core does): once every shard is loaded the
    parameter is the node segment's writable rows, and a fused SGD step (the optimizer made
    before or after loading) moves them exactly as it moves a private layer's."""
    rows = torch.from_numpy(np.random.default_rng(0).normal(
        size=(LAYOUT.padded_rows, LAYOUT.head_dim)).astype(np.float32))
    trained = {}
    for placement in ("cpu", "shared"):
        module = NGramEmbeddingModule(CONFIG, 0, placement=placement, trainable=True,
                                      weight_dtype=torch.float32)
        if made == "before loading":
            fused_optimizer(module, "sgd", lr=0.5)
        module.load_weights([("ngram_embedding.weight", rows)])
        if made == "after loading":
            fused_optimizer(module, "sgd", lr=0.5)
        try:
            assert module.table.placement == placement
            weight = module.ngram_embedding.weight
            assert weight.data_ptr() == module.table.host_view.ctypes.data
            backward_once(module)
            trained[placement] = module.table.host_view.copy()
        finally:
            module.table.close()
    assert not np.array_equal(trained["cpu"], rows.numpy())
    np.testing.assert_array_equal(trained["shared"].view(np.uint32), trained["cpu"].view(np.uint32))


def test_fused_optimizer_needs_a_trainable_module_and_a_known_name():
    with pytest.raises(ValueError, match="not trainable: build it with trainable=True"):
        fused_optimizer(NGramEmbeddingModule(CONFIG, 0, placement="cpu"), "sgd", lr=0.1)
    with pytest.raises(ValueError, match="name must be one of sgd, rowwise_adagrad, adam"):
        fused_optimizer(trained_module(), "lamb", lr=0.1)


@pytest.mark.parametrize("fused", [True, False])
def test_a_prefetch_before_the_update_reads_the_updated_rows(fused):
    """The next micro-step's prefetch gathers before this step's backward and optimizer step;
    its forward still returns the updated rows."""
    module = trained_module()
    sgd = None if fused else torch.optim.SGD([module.ngram_embedding.weight], lr=0.5)
    if fused:
        fused_optimizer(module, "sgd", lr=0.5)
    inputs = batch()
    out = module(*inputs)
    module.start_prefetch(*inputs)  # the same tokens: every row of it is updated
    module.table.prefetcher.threads.wait()  # gathered before the update, surely
    out.square().sum().backward()
    if sgd is not None:
        sgd.step()
    ids = module.compute_ngram_ids(*inputs).numpy()
    again = module(*inputs)
    rows = module.table.host_view[ids.ravel()].reshape(again.shape)
    assert not np.array_equal(rows, out.detach().numpy())
    np.testing.assert_array_equal(again.detach().numpy(), rows)


@pytest.mark.parametrize("fused", [True, False])
def test_an_empty_batch_backward_changes_no_row(fused):
    """An empty batch through a trainable layer's backward: an empty sparse gradient, or a fused
    step that is counted and changes no row (not a reshape error)."""
    module = trained_module()
    optimizer = fused_optimizer(module, "sgd", lr=0.5) if fused else None
    before = module.table.host_view.copy()
    out = module(torch.zeros(0, dtype=torch.int64), torch.tensor([0, 0]),
                 torch.zeros((1, 2), dtype=torch.int64))
    out.sum().backward()
    grad = module.ngram_embedding.weight.grad
    if fused:
        assert grad is None and optimizer.steps == 1
    else:
        assert grad.is_sparse and grad._nnz() == 0 and grad.shape == before.shape
    np.testing.assert_array_equal(module.table.host_view, before)
