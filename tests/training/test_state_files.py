"""Training state files that cannot be read: one ValueError naming the file, nothing changed."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from safetensors.numpy import save_file

import ngram_cupy as nc
from ngram_cupy.training.state_files import FORMAT


def optimizer(value: float = 0.0) -> nc.SGD:
    """An SGD over a small float32 table filled with ``value``."""
    return nc.SGD(nc.EmbeddingTable(np.full((8, 4), value, np.float32)), 0.1)


def truncated(data: bytes) -> bytes:
    return data[:-7]


def header_corrupted(data: bytes) -> bytes:
    return data[:8] + b"X" + data[9:]  # the header's opening brace


def header_cut(data: bytes) -> bytes:
    return data[:5]  # not even the header's length


@pytest.mark.parametrize("damage", [truncated, header_corrupted, header_cut])
def test_a_damaged_file_is_a_value_error_naming_it(tmp_path, damage):
    path = tmp_path / "train.safetensors"
    nc.save_training_state(path, optimizer(1.0))
    path.write_bytes(damage(path.read_bytes()))
    target = optimizer()
    unreadable = f"^{re.escape(str(path))} is not a readable training state file"
    with pytest.raises(ValueError, match=unreadable) as e:
        nc.load_training_state(path, target)
    assert e.value.__cause__ is not None  # the safetensors error, kept
    assert not target.table.host_view.any()


def test_a_corrupted_header_record_is_a_value_error_naming_it(tmp_path):
    path = tmp_path / "train.safetensors"
    for metadata in ({"format": FORMAT, "table_dtype": "float32", "header": "{not json"},
                     {"format": FORMAT, "table_dtype": "float32"}):
        save_file({"rows": np.ones((8, 4), np.float32)}, path, metadata=metadata)
        target = optimizer()
        unreadable = f"^{re.escape(str(path))} is not a readable training state file"
        with pytest.raises(ValueError, match=unreadable) as e:
            nc.load_training_state(path, target)
        assert isinstance(e.value.__cause__, (json.JSONDecodeError, KeyError))
        assert not target.table.host_view.any()
