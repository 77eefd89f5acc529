"""plan_placement on the released sizes and on edge cases."""

from __future__ import annotations

import numpy as np
import pytest

import ngram_cupy as nc
from ngram_cupy.placement import format_bytes, table_nbytes

GiB = 1 << 30
RELEASED_TABLE = 320_001_536 * 16 * 160  # padded rows x (16 heads x 160-byte fp8 rows / 16)


@pytest.fixture(scope="module")
def released_layouts(released_config):
    """Layouts of the released model's first PLE layers (only layer 0's size is pinned down)."""
    return [nc.layer_layout(released_config, layer) for layer in range(3)]


def test_released_table_size(released_layouts):
    layout = released_layouts[0]
    assert layout.padded_rows == 320_001_536
    assert table_nbytes(layout, "float8_e4m3fn") == 320_001_536 * 160 == RELEASED_TABLE // 16
    assert format_bytes(table_nbytes(layout, "float8_e4m3fn")) == "47.68 GiB"
    assert table_nbytes((layout, "bfloat16")) == 2 * 320_001_536 * 160


def test_h200_and_a_terabyte_of_host_memory(released_layouts):
    sizes = {f"layer {i}": table_nbytes(layout, "float8_e4m3fn")
             for i, layout in enumerate(released_layouts)}
    tables = dict(sizes)
    tables.update({f"layer {i}": sizes["layer 0"] for i in range(3, 40)})  # 40 equal layers
    plan = nc.plan_placement(tables, gpu_budget_bytes=100 * GiB, host_budget_bytes=1024 * GiB)
    assert plan.names("gpu") == ["layer 0", "layer 1"]  # two 47.7 GiB tables fit in 100 GiB
    assert len(plan.names("host")) == 21  # 21 x 47.7 GiB <= 1 TiB < 22 x
    assert plan["layer 2"] == "host" and plan["layer 39"] == "none"
    assert not plan.fits
    assert plan.bytes_in("gpu") == sum(sizes[f"layer {i}"] for i in range(2))
    summary = plan.summary()
    assert "40 tables" in summary and "gpu : 2 tables" in summary
    assert "host: 21 tables" in summary and "does not fit: 17 tables" in summary
    assert "layer 39" in summary.splitlines()[-1]


def test_layouts_use_the_configs_dtype(released_config):
    config = nc.NGramConfig(**{**released_config.__dict__,
                               "ple_embedding_dtype": "float8_e4m3fn"})
    layouts = [nc.layer_layout(config, 0)]
    plan = nc.plan_placement(layouts, gpu_budget_bytes=48 * GiB, host_budget_bytes=0)
    assert plan["layer 0"] == "gpu" and plan.fits
    with pytest.raises(ValueError, match="needs a storage dtype"):
        nc.plan_placement([nc.layer_layout(released_config, 0)], 0, 0)
    plan = nc.plan_placement([nc.layer_layout(released_config, 0)], 0, 0, dtype="bfloat16")
    assert plan["layer 0"] == "none"


def test_mixed_tables_fill_in_order():
    table = nc.EmbeddingTable(np.zeros((10, 4), np.float32))  # 160 bytes
    plan = nc.plan_placement([table, 100, 30, 200], gpu_budget_bytes=200, host_budget_bytes=260)
    assert [layer.where for layer in plan.layers] == ["gpu", "host", "gpu", "none"]
    assert [layer.nbytes for layer in plan.layers] == [160, 100, 30, 200]
    assert plan["1"] == "host"
    with pytest.raises(KeyError):
        plan["9"]


def test_exact_fits_and_empty_plans():
    plan = nc.plan_placement({"a": 10, "b": 10}, gpu_budget_bytes=10, host_budget_bytes=10)
    assert plan["a"] == "gpu" and plan["b"] == "host" and plan.fits
    empty = nc.plan_placement([], 0, 0)
    assert empty.fits and "0 tables" in empty.summary()


@pytest.mark.parametrize("tables, gpu, host, error, match", [
    ([1], -1, 0, ValueError, "gpu_budget_bytes must be a non-negative integer"),
    ([1], 0, 1.5, ValueError, "host_budget_bytes"),
    (["big"], 0, 0, TypeError, "a table must be a byte count"),
    ([-3], 0, 0, TypeError, "a table must be"),
])
def test_errors(tables, gpu, host, error, match):
    with pytest.raises(error, match=match):
        nc.plan_placement(tables, gpu, host)


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(5 * (1 << 40)) == "5.00 TiB"
