"""plan_placement on the released sizes and on edge cases."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import ngram_cupy as nc
from ngram_cupy.tables.plan import (
    choose_options,
    format_bytes,
    layer_options,
    lower_hull,
    table_nbytes,
)

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


# ---- hot-row tiers ----

# SPEC's measured curve: the K most used rows of layer 0 serve this share of held-out lookups.
RELEASED_CURVE = [(1_000, 0.057), (10_000, 0.134), (100_000, 0.251), (1_000_000, 0.396)]


def test_tiers_take_the_gpu_budget_when_tables_cannot(released_config):
    layouts = {f"layer {i}": (nc.layer_layout(released_config, 0), "float8_e4m3fn")
               for i in range(4)}
    curves = {name: RELEASED_CURVE for name in layouts}
    plan = nc.plan_placement(layouts, gpu_budget_bytes=GiB, host_budget_bytes=1024 * GiB,
                             hit_rates=curves)
    # Each 1e6-row tier costs 160 MB of rows + 60 MB of slot map: four fit in 1 GiB, the table
    # (47.7 GiB) does not; the 1e3 and 1e4 points save less per byte than 1e5 (under the hull).
    assert [layer.where for layer in plan.layers] == ["host"] * 4
    assert [plan.hot_rows(name) for name in layouts] == [1_000_000] * 4
    hot_bytes = 1_000_000 * 160 + 5_000_024 * 12
    assert plan.bytes_in("gpu") == 4 * hot_bytes
    assert plan.host_bytes_per_token == pytest.approx(4 * 16 * 160 * (1 - 0.396))
    summary = plan.summary()
    assert "hot rows: 4 host tables, 4,000,000 rows" in summary
    assert "layer 3: 1,000,000 rows serve 39.6% of lookups" in summary
    assert "expected host bytes per token: 6,185 (10,240 without hot rows)" in summary
    small = nc.plan_placement(layouts, gpu_budget_bytes=4 * 77 * 10**6,
                              host_budget_bytes=1024 * GiB, hit_rates=curves)
    assert [small.hot_rows(name) for name in layouts] == [100_000] * 4
    untiered = nc.plan_placement(layouts, 0, 1024 * GiB)
    assert untiered.host_bytes_per_token == 4 * 2560
    assert "expected host bytes per token: 10,240" in untiered.summary()


def test_the_better_curve_gets_the_tier(released_config):
    layout = (nc.layer_layout(released_config, 0), "float8_e4m3fn")
    flat = [(1_000_000, 0.05)]
    plan = nc.plan_placement({"a": layout, "b": layout}, gpu_budget_bytes=300 * 10**6,
                             host_budget_bytes=1024 * GiB,
                             hit_rates={"a": flat, "b": RELEASED_CURVE})
    assert plan.hot_rows("a") == 0 and plan.hot_rows("b") == 1_000_000


def test_resident_when_the_budget_allows(released_config):
    layout = (nc.layer_layout(released_config, 0), "float8_e4m3fn")
    plan = nc.plan_placement([layout, layout], gpu_budget_bytes=50 * GiB,
                             host_budget_bytes=1024 * GiB, hit_rates=[RELEASED_CURVE, None])
    # One table (47.7 GiB) resident saves all its traffic; the other gets the rest as a tier.
    assert sorted(layer.where for layer in plan.layers) == ["gpu", "host"]
    assert plan.bytes_in("gpu") <= 50 * GiB


def least_traffic(option_lists, budget):
    """The least total traffic within ``budget``, over every combination of options."""
    best = float("inf")
    for combo in itertools.product(*option_lists):
        if sum(option.gpu_nbytes for option in combo) <= budget:
            best = min(best, sum(option.traffic for option in combo))
    return best


def test_greedy_against_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(300):
        option_lists, hulls = [], []
        for _ in range(rng.integers(1, 4)):
            rows = int(rng.integers(1_000, 100_000))
            ks = np.unique(rng.integers(1, rows, rng.integers(0, 4)))
            shares = np.sort(rng.uniform(0, 1, ks.size))
            options = layer_options(rows * 64, (rows, 64, 4), list(zip(ks, shares, strict=True)))
            option_lists.append(options)
            hulls.append(lower_hull(options))
        budget = int(rng.integers(0, sum(o[-1].gpu_nbytes for o in option_lists) + 2))
        chosen = choose_options(hulls, budget)
        picked = [hull[at] for hull, at in zip(hulls, chosen, strict=True)]
        assert sum(option.gpu_nbytes for option in picked) <= budget
        traffic = sum(option.traffic for option in picked)
        best = least_traffic(option_lists, budget)
        largest_step = max((a.traffic - b.traffic for hull in hulls
                            for a, b in zip(hull, hull[1:], strict=False)), default=0.0)
        assert best - 1e-9 <= traffic <= best + largest_step + 1e-9
        if budget >= sum(o[-1].gpu_nbytes for o in option_lists):
            assert traffic == 0.0


@pytest.mark.parametrize("curve, match", [
    ([(-1, 0.1)], r"0 <= hot rows <= 320001536"),
    ([(320_001_537, 0.1)], r"0 <= hot rows <= 320001536"),
    ([(10, 1.5)], "hit share <= 1"),
    ([(10, 0.5), (20, 0.4)], "must not fall"),
    (["x"], "list of \\(hot rows, hit share\\) pairs"),
])
def test_bad_curves(released_config, curve, match):
    layout = (nc.layer_layout(released_config, 0), "float8_e4m3fn")
    with pytest.raises(ValueError, match=match):
        nc.plan_placement({"a": layout}, GiB, GiB, hit_rates={"a": curve})


def test_stats_curves_with_a_zero_point(released_config):
    layout = (nc.layer_layout(released_config, 0), "float8_e4m3fn")
    ks, shares = [0, 100_000], np.array([0.0, 0.251])  # as stats.hit_rate_curve gives them
    plan = nc.plan_placement({"a": layout}, GiB, 1024 * GiB,
                             hit_rates={"a": zip(ks, shares, strict=True)})
    assert plan.hot_rows("a") == 100_000


def test_curves_need_layouts(released_config):
    with pytest.raises(ValueError, match="hit_rates need the table as a LayerLayout"):
        nc.plan_placement([100], 0, 100, hit_rates=[[(1, 0.5)]])
    with pytest.raises(ValueError, match="one entry per table"):
        nc.plan_placement([100], 0, 100, hit_rates=[])
    with pytest.raises(ValueError, match="not planned"):
        nc.plan_placement({"a": 100}, 0, 100, hit_rates={"b": None})


def test_host_tables_of_a_node_with_several_processes_are_shared():
    GiB = 1 << 30
    single = nc.plan_placement({"a": 2 * GiB, "b": 3 * GiB, "c": 9 * GiB}, 2 * GiB, 4 * GiB)
    node = nc.plan_placement({"a": 2 * GiB, "b": 3 * GiB, "c": 9 * GiB}, 2 * GiB, 4 * GiB,
                             processes_per_node=8)
    assert [single.placement(n) for n in "ab"] == ["gpu", "pinned"]
    assert [node.placement(n) for n in "ab"] == ["gpu", "shared"]
    assert node.layers == single.layers  # one copy per node: the node's budget holds it once
    assert "one shared copy for 8 processes" in node.summary()
    with pytest.raises(ValueError, match="fits in neither budget"):
        node.placement("c")
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="processes_per_node"):
            nc.plan_placement([GiB], GiB, GiB, processes_per_node=bad)


def test_block_scaled_tables_are_not_planned_as_shared():
    """placement='shared' refuses NVFP4 / MXFP8 rows (their block scales live beside them): a
    plan naming it for them would fail at load, with the node's budget counted once."""
    config = nc.NGramConfig(vocab_size=1000, ngram_size=3, heads_per_ngram=2,
                            ngram_vocab_size_base=500, eos_token_id=0, embedding_dim=64,
                            split_ngram_parts=4, ple_embedding_dtype="nvfp4")
    layout = nc.layer_layout(config, 0)
    table = nc.EmbeddingTable.empty(8, 32, "mxfp8")
    for tables, dtype in (({"t": layout}, None), ({"t": (layout, "nvfp4")}, None),
                          ({"t": layout}, "nvfp4"), ({"t": table}, None)):
        assert nc.plan_placement(tables, 0, 1 << 30, dtype).placement("t") == "pinned"
        with pytest.raises(ValueError, match=r"table t is (nvfp4|mxfp8): placement 'shared'"):
            nc.plan_placement(tables, 0, 1 << 30, dtype, processes_per_node=4)
    assert nc.plan_placement({"t": layout}, 0, 1 << 30, "float8_e4m3fn",
                             processes_per_node=4).placement("t") == "shared"
