"""A prefetch during gradient accumulation under autograd (issue 43): the forward after the
optimizer step returns the rows it wrote."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from test_torch_training import batch, trained_module  # noqa: E402


def test_gradient_accumulation_with_prefetch_reads_updated_rows():
    """Micro-step 1 backward; forward b2, prefetch b1, backward, optimizer step: the next
    forward of b1 returns the rows the step wrote."""

    module = trained_module()
    sgd = torch.optim.SGD([module.ngram_embedding.weight], lr=0.5)
    first, second = batch(1), batch(5)
    module(*first).square().sum().backward()  # micro-step 1: accumulated, not stepped
    out = module(*second)
    module.start_prefetch(*first)
    module.table.prefetcher.threads.wait()  # gathered before the update, surely
    out.square().sum().backward()
    sgd.step()
    again = module(*first)
    ids = module.compute_ngram_ids(*first).numpy()
    rows = module.table.host_view[ids.ravel()].reshape(again.shape)
    np.testing.assert_array_equal(again.detach().numpy(), rows)
