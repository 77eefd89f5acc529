"""Every public reader of a table's rows waits for the asynchronous updates issued before it
(``EmbeddingTable.wait_for_updates``): each reader, called while an update is held on the
worker, returns what it returns after the same steps taken synchronously. ``READERS`` is the
list; a face that reads the rows (torch's ``state_dict``, ``torch.export``) adds its own."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

import ngram_cupy as nc
from ngram_cupy.torch import NGramEmbeddingModule

CONFIG = nc.NGramConfig(vocab_size=50, ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=11,
                        eos_token_id=0, embedding_dim=8)
LAYOUT = nc.layer_layout(CONFIG, 0)
ROWS, DIM = LAYOUT.padded_rows, LAYOUT.head_dim
ALL_IDS = np.arange(ROWS).reshape(-1, 1)


def saved_layer_checkpoint(table, module, folder):
    nc.save_ngram_embedding(folder / "layer.safetensors", CONFIG, 0, table)
    return load_file(folder / "layer.safetensors")


def saved_state(table, module, folder):
    return load_file(nc.save_training_state(folder / "state.safetensors", module.optimizer))[
        "rows"]


def closed(table, module, folder):
    table.close()
    return table.storage.host_view  # the private rows, read past the table


def exported(table, module, folder):
    """``torch.export``'s program holds the rows it traced as its state (sharing the table's)."""
    tokens = torch.arange(1, 6)
    program = torch.export.export(module, (tokens, torch.tensor([0, 5]),
                                           torch.zeros((1, 2), dtype=torch.int64)))
    return {name: value.numpy().copy() for name, value in program.state_dict.items()}


# name -> reader(table, module, folder), ``module`` the torch layer over ``table`` (its
# ``optimizer`` the one stepping): what it returns must hold every issued update.
READERS = {
    "host_view": lambda table, module, folder: table.host_view,
    "lookup": lambda table, module, folder: table.lookup(ALL_IDS),
    "quantize_table": lambda table, module, folder: nc.quantize_table(table, "fp8")
    .table_arguments()["weight"],
    "save_ngram_embedding": saved_layer_checkpoint,
    "save_training_state": saved_state,
    "close": closed,
    "torch state_dict": lambda table, module, folder: {
        name: value.numpy().copy() for name, value in module.state_dict().items()},
    "torch.export": exported,
}
# Readers that give what a cheaper one gives, checked against it (one export instead of three).
SAME_AS = {"torch.export": "torch state_dict"}


def stepped_layer(asynchronous: bool, steps: int = 1) -> NGramEmbeddingModule:
    """A torch layer whose table took ``steps`` SGD steps (its ``optimizer``); with
    ``asynchronous``, the step is held on the worker until the table is waited for
    (``wait_for_updates``) or, for readers that wait otherwise, a timer releases it: a reader
    that does not wait reads the rows before the step."""
    module = NGramEmbeddingModule(CONFIG, 0, placement="cpu")
    module.load_weights([("ngram_embedding.weight", torch.from_numpy(
        np.random.default_rng(0).standard_normal((ROWS, DIM)).astype(np.float32)))])
    optimizer = module.optimizer = nc.SGD(module.table, lr=0.5, asynchronous=asynchronous)
    gate = threading.Event()
    apply = optimizer.apply
    optimizer.apply = lambda *args: (gate.wait(10), apply(*args))
    if not asynchronous:
        gate.set()
    for _ in range(steps):
        optimizer.step_from_output_grad(ALL_IDS, np.ones((ROWS, DIM), np.float32))
    wait = module.table.wait_for_updates
    module.table.wait_for_updates = lambda: (gate.set(), wait())[1]
    threading.Timer(0.5, gate.set).start()
    return module


def as_bytes(value) -> bytes:
    if isinstance(value, dict):
        return b"".join(as_bytes(value[key]) for key in sorted(value))
    return np.ascontiguousarray(value).tobytes()


@pytest.mark.parametrize("reader", READERS)
def test_each_reader_waits_for_pending_updates(reader, tmp_path):
    for name in ("sync", "async", "untrained"):
        (tmp_path / name).mkdir()
    reference = READERS[SAME_AS.get(reader, reader)]
    module = stepped_layer(asynchronous=False)
    expected = as_bytes(reference(module.table, module, tmp_path / "sync"))
    untrained = stepped_layer(asynchronous=False, steps=0)
    assert as_bytes(reference(untrained.table, untrained, tmp_path / "untrained")) != expected
    module = stepped_layer(asynchronous=True)
    assert as_bytes(READERS[reader](module.table, module, tmp_path / "async")) == expected
    module.optimizer.close()


def test_the_training_page_names_every_reader():
    """docs/training.md says which readers wait: each of ``READERS`` is named there."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "training.md").read_text()
    text = page[page.index("Coherence, the rule"):page.index("The update kernels are compiled")]
    spans = " ".join(re.findall(r"`([^`]*)`", text))  # the code the page names
    assert [name for name in READERS if not re.search(rf"\b{re.escape(name.split()[-1])}\b",
                                                      spans)] == []


def test_save_ngram_embedding_takes_a_table(tmp_path):
    weight = np.random.default_rng(1).standard_normal((ROWS, DIM)).astype(np.float32)
    for table, path in ((nc.EmbeddingTable(weight), tmp_path / "one.safetensors"),
                        (nc.EmbeddingTable(weight.astype(np.float16)), tmp_path / "model")):
        nc.save_ngram_embedding(path, CONFIG, 0, table)
        loaded = nc.load_ngram_embedding(path, CONFIG, 0).table
        assert loaded.host_view.tobytes() == table.host_view.tobytes()
    with pytest.raises(ValueError, match="brings its own scale"):
        nc.save_ngram_embedding(tmp_path / "x.safetensors", CONFIG, 0, nc.EmbeddingTable(weight),
                                scale=2.0)
    shard = nc.EmbeddingTable(weight[:10], row_start=10, total_rows=ROWS)
    with pytest.raises(ValueError, match="save the whole table"):
        nc.save_ngram_embedding(tmp_path / "x.safetensors", CONFIG, 0, shard)
