"""Every public reader of a table's rows waits for the asynchronous updates issued before it
(``EmbeddingTable.wait_for_updates``): each reader, called while an update is held on the
worker, returns what it returns after the same steps taken synchronously. ``READERS`` is the
list; a face that reads the rows (torch's ``state_dict``, ``torch.export``) adds its own."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from safetensors.numpy import load_file

import ngram_cupy as nc

CONFIG = nc.NGramConfig(vocab_size=50, ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=11,
                        eos_token_id=0, embedding_dim=8)
LAYOUT = nc.layer_layout(CONFIG, 0)
ROWS, DIM = LAYOUT.padded_rows, LAYOUT.head_dim
ALL_IDS = np.arange(ROWS).reshape(-1, 1)


def saved_checkpoint(table, optimizer, folder):
    nc.save_ngram_embedding(folder / "layer.safetensors", CONFIG, 0, table)
    return load_file(folder / "layer.safetensors")


def saved_state(table, optimizer, folder):
    return load_file(nc.save_training_state(folder / "state.safetensors", optimizer))["rows"]


def closed(table, optimizer, folder):
    table.close()
    return table.storage.host_view  # the private rows, read past the table


# name -> reader(table, optimizer, folder): what it returns must hold every issued update.
READERS = {
    "host_view": lambda table, optimizer, folder: table.host_view,
    "lookup": lambda table, optimizer, folder: table.lookup(ALL_IDS),
    "quantize_table": lambda table, optimizer, folder: nc.quantize_table(table, "fp8")
    .table_arguments()["weight"],
    "save_ngram_embedding": saved_checkpoint,
    "save_training_state": saved_state,
    "close": closed,
}


def trained(asynchronous: bool):
    """A table after one SGD step; with ``asynchronous``, the step is held on the worker until
    a timer releases it (the reader must wait for it)."""
    table = nc.EmbeddingTable(np.random.default_rng(0).standard_normal((ROWS, DIM))
                              .astype(np.float32))
    optimizer = nc.SGD(table, lr=0.5, asynchronous=asynchronous)
    gate = threading.Event()
    apply = optimizer.apply
    optimizer.apply = lambda *args: (gate.wait(10), apply(*args))
    if not asynchronous:
        gate.set()
    optimizer.step_from_output_grad(ALL_IDS, np.ones((ROWS, DIM), np.float32))
    threading.Timer(0.05, gate.set).start()
    return table, optimizer


def as_bytes(value) -> bytes:
    if isinstance(value, dict):
        return b"".join(as_bytes(value[key]) for key in sorted(value))
    return np.ascontiguousarray(value).tobytes()


@pytest.mark.parametrize("reader", READERS)
def test_each_reader_waits_for_pending_updates(reader, tmp_path):
    (tmp_path / "sync").mkdir()
    (tmp_path / "async").mkdir()
    table, optimizer = trained(asynchronous=False)
    expected = as_bytes(READERS[reader](table, optimizer, tmp_path / "sync"))
    untrained = nc.EmbeddingTable(np.random.default_rng(0).standard_normal((ROWS, DIM))
                                  .astype(np.float32))
    assert as_bytes(READERS[reader](untrained, nc.SGD(untrained, lr=0.5), tmp_path)) != expected
    table, optimizer = trained(asynchronous=True)
    assert as_bytes(READERS[reader](table, optimizer, tmp_path / "async")) == expected
    optimizer.close()


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
