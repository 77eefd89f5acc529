"""The ids command's pipeline: overlapped reading and writing keeps order, errors and exact ids."""

from __future__ import annotations

import numpy as np
import pytest

import ngram_cupy as nc

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from ngram_cupy import pipeline  # noqa: E402
from ngram_cupy.arrow import NGramIds  # noqa: E402

CONFIG = nc.NGramConfig(vocab_size=1000, ngram_size=3, heads_per_ngram=2,
                        ngram_vocab_size_base=5000, eos_token_id=0)


def token_batches(count: int, rows: int = 5) -> list:
    """``count`` record batches of random token rows with a document id per batch."""
    rng = np.random.default_rng(3)
    batches = []
    for i in range(count):
        offsets = np.cumsum([0, *rng.integers(0, 40, rows)]).astype(np.int32)
        tokens = pa.array(rng.integers(0, 1000, offsets[-1]).astype(np.int32))
        batches.append(pa.record_batch({"doc": pa.array([i // 2] * rows),
                                        "tokens": pa.ListArray.from_arrays(offsets, tokens)}))
    return batches


def test_read_ahead_keeps_order_and_raises_the_producers_error():
    assert list(pipeline.read_ahead(range(50))) == list(range(50))

    def failing():
        yield 1
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        list(pipeline.read_ahead(failing()))


def test_read_ahead_stops_its_producer_when_closed():
    produced = []

    def endless():
        for i in range(10**9):
            produced.append(i)
            yield i

    items = pipeline.read_ahead(endless())
    assert next(items) == 0
    items.close()
    count = len(produced)
    assert count <= 2 + pipeline.DEPTH
    assert len(produced) == count


def test_background_writer_raises_the_write_error_in_the_caller():
    def write(table):
        raise ValueError("no space")

    out = pipeline.BackgroundWriter(write)
    out.put(pa.table({"a": [1]}))
    with pytest.raises(ValueError, match="no space"):
        out.close()


@pytest.mark.parametrize("id_type", ["int32", "int64"])
def test_written_ids_equal_the_mapped_batches(tmp_path, monkeypatch, id_type):
    monkeypatch.setattr(pipeline, "ROW_GROUP_BYTES", 2000)  # several row groups
    layout = nc.layer_layout(CONFIG, 0)
    batches = token_batches(9)
    expected = NGramIds(layout, doc_id_column="doc")(pa.Table.from_batches(batches))
    mapper = NGramIds(layout, doc_id_column="doc", id_type=id_type)
    schema = mapper.output_schema(batches[0].schema)
    seen = []
    path = tmp_path / "out.parquet"
    pipeline.write_ids(iter(batches), mapper, str(path), schema,
                       pipeline.writer_options(schema, batches[0].schema), seen.append)
    written = pq.read_table(path)
    assert [batch.num_rows for batch in seen] == [batch.num_rows for batch in batches]
    assert written.schema.field("ngram_ids").type.value_type.value_type == id_type
    assert pq.ParquetFile(path).metadata.num_row_groups > 1
    assert written.column("ngram_ids").to_pylist() == expected.column("ngram_ids").to_pylist()


def test_id_types():
    layout = nc.layer_layout(CONFIG, 0)
    assert NGramIds(layout, id_type="auto").id_type == "int32"
    with pytest.raises(ValueError, match="id_type"):
        NGramIds(layout, id_type="int16")
