"""The ids command's pipeline: overlapped reading and writing keeps order, errors and exact ids."""

from __future__ import annotations

import numpy as np
import pytest

import ngram_cupy as nc

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from ngram_cupy.arrow import NGramIds  # noqa: E402
from ngram_cupy.files import pipeline  # noqa: E402

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


def test_row_groups_grow_from_a_small_first_one(tmp_path, monkeypatch):
    monkeypatch.setattr(pipeline, "FIRST_ROW_GROUP_BYTES", 1000)
    monkeypatch.setattr(pipeline, "ROW_GROUP_BYTES", 6000)
    layout = nc.layer_layout(CONFIG, 0)
    tokens = pa.array(np.arange(40 * 20, dtype=np.int32) % 1000)
    batches = [pa.record_batch({"doc": pa.array([i // 4]), "tokens": pa.ListArray.from_arrays(
        pa.array([0, 20], pa.int32()), tokens.slice(20 * i, 20))}) for i in range(40)]
    mapper = NGramIds(layout, doc_id_column="doc")
    schema = mapper.output_schema(batches[0].schema)
    path = tmp_path / "out.parquet"
    pipeline.write_ids(iter(batches), mapper, str(path), schema,
                       pipeline.writer_options(schema, batches[0].schema), lambda batch: None)
    metadata = pq.ParquetFile(path).metadata
    rows = [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)]
    assert sum(rows) == 40
    assert rows[:4] == sorted(rows[:4]) and len(set(rows[:4])) == 4, rows  # doubling
    assert max(rows) == rows[3] and rows[0] * 4 < rows[3], rows  # up to ROW_GROUP_BYTES
    expected = NGramIds(layout, doc_id_column="doc")(pa.Table.from_batches(batches))
    assert pq.read_table(path).equals(expected)


@pytest.mark.parametrize("existing", [b"", b"not parquet " * 100])
def test_output_replaces_an_existing_file_whole(tmp_path, existing):
    layout = nc.layer_layout(CONFIG, 0)
    batches = token_batches(3)
    mapper = NGramIds(layout, doc_id_column="doc")
    schema = mapper.output_schema(batches[0].schema)
    path = tmp_path / "out.parquet"
    path.write_bytes(existing)  # empty: a reserved temporary, written without truncating it
    pipeline.write_ids(iter(batches), mapper, str(path), schema,
                       pipeline.writer_options(schema, batches[0].schema), lambda batch: None)
    expected = NGramIds(layout, doc_id_column="doc")(pa.Table.from_batches(batches))
    assert pq.read_table(path).equals(expected)
    assert path.read_bytes()[:4] == b"PAR1"


def test_ids_run_on_one_numba_thread_and_the_callers_count_is_kept(tmp_path):
    numba = pytest.importorskip("numba")
    layout = nc.layer_layout(CONFIG, 0)
    batches = token_batches(3)
    ids = NGramIds(layout, doc_id_column="doc")
    counts = []

    def mapper(batch):
        counts.append(numba.get_num_threads())
        return ids(batch)

    schema = ids.output_schema(batches[0].schema)
    before = numba.get_num_threads()
    pipeline.write_ids(iter(batches), mapper, str(tmp_path / "out.parquet"), schema,
                       pipeline.writer_options(schema, batches[0].schema), lambda batch: None)
    assert counts == [1, 1, 1]
    assert numba.get_num_threads() == before


def test_tokens_per_call_fill_the_call_bytes():
    assert pipeline.tokens_per_call(16, 4) * 16 * 4 == pipeline.CALL_IDS_BYTES
    assert pipeline.tokens_per_call(10**9, 8) == 1


def test_id_types():
    layout = nc.layer_layout(CONFIG, 0)
    assert NGramIds(layout, id_type="auto").id_type == "int32"
    with pytest.raises(ValueError, match="id_type"):
        NGramIds(layout, id_type="int16")
