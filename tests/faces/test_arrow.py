"""Arrow batches: ids equal compute_ngram_ids on flattened tokens; documents continue; errors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ngram_cupy as nc

pa = pytest.importorskip("pyarrow")
ds = pytest.importorskip("pyarrow.dataset")
pq = pytest.importorskip("pyarrow.parquet")

from ngram_cupy.arrow import NGramIds, ngram_ids_batch, ngram_ids_batches  # noqa: E402
from ngram_cupy.files.token_files import token_slices  # noqa: E402

CONFIG = nc.NGramConfig(vocab_size=50, ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=40,
                        eos_token_id=7)
LAYOUT = nc.layer_layout(CONFIG, 0)
LAYOUT1 = nc.layer_layout(CONFIG, 1)
EOS = CONFIG.eos_token_id
LIST_TYPES = [pa.list_, pa.large_list]
VALUE_TYPES = [pa.int32(), pa.int64()]


def fresh_context(rows: int) -> np.ndarray:
    """All-EOS contexts: every request starts a new sequence."""
    return np.full((rows, CONFIG.ngram_size - 1), EOS, dtype=np.int64)


def expected_ids(rows: list[list[int]], layout=LAYOUT) -> list[np.ndarray]:
    """Per-row ids from ``compute_ngram_ids`` on the flattened tokens, each row a request."""
    tokens = np.array([t for row in rows for t in row], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum([len(row) for row in rows])]).astype(np.int64)
    ids = nc.compute_ngram_ids(layout, tokens, starts, fresh_context(len(rows)))
    return [ids[starts[i] : starts[i + 1]] for i in range(len(rows))]


def expected_document_ids(rows: list[list[int]], doc_ids: list, layout=LAYOUT) -> list[np.ndarray]:
    """Per-row ids when runs of equal document ids are processed as whole documents."""
    runs: list[list[int]] = []
    for i in range(len(rows)):
        if i == 0 or doc_ids[i] != doc_ids[i - 1]:
            runs.append([])
        runs[-1].append(i)
    result = []
    for run, ids in zip(runs, expected_ids([sum((rows[i] for i in run), []) for run in runs],
                                           layout), strict=True):
        position = 0
        for i in run:
            result.append(ids[position : position + len(rows[i])])
            position += len(rows[i])
    return result


def id_rows(column) -> list[np.ndarray]:
    """The ids column as one ``[tokens, H]`` array per row."""
    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    return [np.array(row, dtype=np.int64).reshape(-1, LAYOUT.num_heads) for row in
            column.to_pylist()]


def assert_rows_equal(actual: list[np.ndarray], expected: list[np.ndarray]) -> None:
    """Row by row equality of id arrays."""
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        np.testing.assert_array_equal(a, e)


def token_array(rows, list_type=pa.list_, value_type=None):
    """A list array of token rows (int32 unless ``value_type`` says otherwise)."""
    return pa.array(rows, list_type(value_type or pa.int32()))


token = st.one_of(st.just(EOS), st.integers(0, CONFIG.vocab_size - 1))
rows_strategy = st.lists(st.lists(token, max_size=12), max_size=10)


@settings(max_examples=60, deadline=None)
@given(rows=rows_strategy, data=st.data(), list_type=st.sampled_from(LIST_TYPES),
       value_type=st.sampled_from(VALUE_TYPES))
def test_sliced_batches_match_flattened_tokens(rows, data, list_type, value_type):
    start = data.draw(st.integers(0, len(rows)))
    stop = data.draw(st.integers(start, len(rows)))
    batch = pa.record_batch({"tokens": token_array(rows, list_type, value_type)})
    out = ngram_ids_batch(batch.slice(start, stop - start), LAYOUT)
    assert out.column("ngram_ids").type == list_type(pa.list_(pa.int64(), LAYOUT.num_heads))
    assert out.column("tokens").equals(batch.column("tokens").slice(start, stop - start))
    assert_rows_equal(id_rows(out.column("ngram_ids")), expected_ids(rows[start:stop]))


@settings(max_examples=40, deadline=None)
@given(chunks=st.lists(rows_strategy, min_size=1, max_size=4),
       list_type=st.sampled_from(LIST_TYPES))
def test_chunked_table_matches_flattened_tokens(chunks, list_type):
    table = pa.Table.from_batches(
        [pa.record_batch({"tokens": token_array(rows, list_type)}) for rows in chunks])
    out = ngram_ids_batch(table, LAYOUT)
    assert isinstance(out, pa.Table)
    # one output chunk per record batch of the table: no concatenation
    assert [len(chunk) for chunk in out.column("ngram_ids").chunks] == [
        batch.num_rows for batch in table.to_batches()]
    assert_rows_equal(id_rows(out.column("ngram_ids")), expected_ids(sum(chunks, [])))


@settings(max_examples=60, deadline=None)
@given(rows=rows_strategy, data=st.data(), max_tokens=st.integers(1, 20),
       list_type=st.sampled_from(LIST_TYPES))
def test_token_slices_hold_whole_rows_up_to_the_budget(rows, data, max_tokens, list_type):
    start = data.draw(st.integers(0, len(rows)))
    batch = pa.record_batch({"tokens": token_array(rows, list_type),
                             "doc": pa.array(range(len(rows)))}).slice(start)
    pieces = list(token_slices([batch], "tokens", max_tokens))
    assert pa.Table.from_batches(pieces, batch.schema).equals(pa.Table.from_batches([batch]))
    for piece in pieces:
        lengths = [len(row) for row in piece.column("tokens").to_pylist()]
        assert piece.num_rows >= 1 or batch.num_rows == 0
        assert sum(lengths) <= max_tokens or piece.num_rows == 1
    for piece, following in zip(pieces[:-1], pieces[1:], strict=True):  # slices take what fits
        first = len(following.column("tokens")[0].as_py())
        assert sum(len(r) for r in piece.column("tokens").to_pylist()) + first > max_tokens


def test_token_slices_with_a_budget_beyond_int32_offsets_take_the_batch_whole():
    batch = pa.record_batch({"tokens": token_array([[1, 2], [3]])})
    assert list(token_slices([batch], "tokens", 1 << 40)) == [batch]


def test_token_slices_pass_batches_without_the_column_whole():
    batch = pa.record_batch({"text": pa.array(["a b", "c"])})
    assert list(token_slices([batch], "tokens", 1)) == [batch]


def test_offsets_reused_without_copying():
    batch = pa.record_batch({"tokens": token_array([[1, 2, 3], [], [4, 5], [6]])})
    column = ngram_ids_batch(batch, LAYOUT).column("ngram_ids")
    offsets = batch.column("tokens").offsets
    assert column.offsets.buffers()[1].address == offsets.buffers()[1].address
    ids = column.values
    assert ids.offset == 0 and len(ids.values) == 6 * LAYOUT.num_heads  # one buffer, T x H


def test_sliced_offsets_rebased():
    batch = pa.record_batch({"tokens": token_array([[1, 2, 3], [4, 5], [6], []])}).slice(1, 2)
    column = ngram_ids_batch(batch, LAYOUT).column("ngram_ids")
    assert column.offsets.to_pylist() == [0, 2, 3]
    assert len(column.values) == 3


def test_empty_rows_and_batches():
    for rows in ([], [[]], [[], [], []], [[], [3], []]):
        out = ngram_ids_batch(pa.record_batch({"tokens": token_array(rows)}), LAYOUT)
        assert_rows_equal(id_rows(out.column("ngram_ids")), expected_ids(rows))
    table = pa.table({"tokens": token_array([])}).slice(0, 0)
    assert ngram_ids_batch(table, LAYOUT).num_rows == 0


def split_documents(documents, cuts):
    """Rows and their document ids from whole documents cut at the given relative points."""
    rows, doc_ids = [], []
    for doc_id, (document, doc_cuts) in enumerate(zip(documents, cuts, strict=True)):
        points = sorted(min(c, len(document)) for c in doc_cuts)
        for first, last in zip([0, *points], [*points, len(document)], strict=True):
            rows.append(document[first:last])
            doc_ids.append(doc_id)
    return rows, doc_ids


documents_strategy = st.lists(st.lists(token, max_size=20), min_size=1, max_size=5)


@settings(max_examples=60, deadline=None)
@given(documents=documents_strategy, data=st.data())
def test_documents_split_into_rows_and_batches_match_whole(documents, data):
    cuts = [data.draw(st.lists(st.integers(0, 20), max_size=4)) for _ in documents]
    rows, doc_ids = split_documents(documents, cuts)
    whole = expected_ids(documents)
    expected = expected_document_ids(rows, doc_ids)
    assert np.array_equal(np.concatenate([np.zeros((0, 4)), *expected]),
                          np.concatenate([np.zeros((0, 4)), *whole]))
    batch = pa.record_batch({"doc": pa.array(doc_ids, pa.int64()), "tokens": token_array(rows)})
    # one batch
    out = ngram_ids_batch(batch, LAYOUT, doc_id_column="doc")
    assert_rows_equal(id_rows(out.column("ngram_ids")), expected)
    # several batches in a stream (documents continue across batch boundaries), and as a table
    bounds = sorted(data.draw(st.lists(st.integers(0, len(rows)), max_size=4)))
    pieces = [batch.slice(a, b - a) for a, b in zip([0, *bounds], [*bounds, len(rows)],
                                                     strict=True)]
    streamed = [row for piece in ngram_ids_batches(pieces, LAYOUT, doc_id_column="doc")
                for row in id_rows(piece.column("ngram_ids"))]
    assert_rows_equal(streamed, expected)
    out = ngram_ids_batch(pa.Table.from_batches(pieces, batch.schema), LAYOUT,
                          doc_id_column="doc")
    assert_rows_equal(id_rows(out.column("ngram_ids")), expected)


def test_context_carried_from_the_last_document_of_a_batch():
    rows = [[1, 2, 3], [4, 5], [6], [11, 12]]
    doc_ids = [0, 0, 1, 1]
    batch = pa.record_batch({"doc": doc_ids, "tokens": token_array(rows)})
    # batch 2 continues document 0 and starts document 1 (shorter than the context), which
    # batch 3 continues
    pieces = [batch.slice(0, 1), batch.slice(1, 2), batch.slice(3, 1)]
    streamed = [row for piece in ngram_ids_batches(pieces, LAYOUT, doc_id_column="doc")
                for row in id_rows(piece.column("ngram_ids"))]
    assert_rows_equal(streamed, expected_document_ids(rows, doc_ids))


def test_document_ids_of_any_comparable_type_and_fresh_restarts():
    rows = [[1, 2], [3, 4], [5], [6, 7], [8]]
    for doc_ids in (["a", "a", "b", "a", "a"], [3, 3, 9, 3, 3]):
        batch = pa.record_batch({"tokens": token_array(rows), "doc": pa.array(doc_ids)})
        out = ngram_ids_batch(batch, LAYOUT, doc_id_column="doc")
        # only consecutive rows continue: the document-id reappearing later starts afresh
        assert_rows_equal(id_rows(out.column("ngram_ids")),
                          expected_document_ids(rows, doc_ids))
        assert not np.array_equal(id_rows(out.column("ngram_ids"))[1],
                                  expected_ids(rows)[1])


def test_without_document_ids_every_row_is_fresh():
    rows = [[1, 2, 3], [4, 5, 6]]
    batch = pa.record_batch({"tokens": token_array(rows), "doc": [0, 0]})
    out = ngram_ids_batch(batch, LAYOUT)
    assert_rows_equal(id_rows(out.column("ngram_ids")), expected_ids(rows))


def test_several_layers_give_one_column_each():
    rows = [[1, 2, 3, EOS, 4], [5]]
    batch = pa.record_batch({"tokens": token_array(rows)})
    out = ngram_ids_batch(batch, [LAYOUT, LAYOUT1])
    assert out.schema.names == ["tokens", "ngram_ids_layer0", "ngram_ids_layer1"]
    assert_rows_equal(id_rows(out.column("ngram_ids_layer0")), expected_ids(rows, LAYOUT))
    assert_rows_equal(id_rows(out.column("ngram_ids_layer1")), expected_ids(rows, LAYOUT1))
    generated = ngram_ids_batch(batch, (layout for layout in (LAYOUT, LAYOUT1)))
    assert generated.equals(out)  # an iterator of layouts works too
    named = ngram_ids_batch(batch, [LAYOUT1], out_column="ple")
    assert named.schema.names == ["tokens", "ple"]  # one layout, in a list or not: one name
    assert ngram_ids_batch(batch, [LAYOUT]).equals(ngram_ids_batch(batch, LAYOUT))
    assert NGramIds([LAYOUT], id_type="auto")(batch).column("ngram_ids").type.value_type \
        .value_type == pa.int32()  # the CLI's and Ray's ids; int64 by default
    assert ngram_ids_batch(batch, LAYOUT, out_column="ids").schema.names == ["tokens", "ids"]


def test_dataset_scan_streams_multi_file_datasets(tmp_path):
    rows, doc_ids = split_documents([list(range(30)), [1, 2, EOS, 3] * 5, [9] * 7],
                                    [[5, 11, 25], [3, 7], []])
    table = pa.table({"doc": doc_ids, "tokens": token_array(rows)})
    source = tmp_path / "source"
    source.mkdir()
    for i, first in enumerate(range(0, len(rows), 3)):  # documents span files
        pq.write_table(table.slice(first, 3), source / f"part-{i:02d}.parquet")
    dataset = ds.dataset(source, format="parquet")
    mapper = NGramIds(LAYOUT, doc_id_column="doc")
    ds.write_dataset(map(mapper, dataset.to_batches(batch_size=2)), tmp_path / "out",
                     schema=mapper.output_schema(dataset.schema), format="parquet",
                     preserve_order=True)  # otherwise a busy CPU may write batches out of order
    result = ds.dataset(tmp_path / "out", format="parquet").to_table()
    assert result.column("doc").to_pylist() == doc_ids
    assert_rows_equal(id_rows(result.column("ngram_ids")), expected_document_ids(rows, doc_ids))


def test_mapper_keeps_no_state_without_document_ids():
    mapper = NGramIds(LAYOUT)
    batch = pa.record_batch({"tokens": token_array([[1, 2], [3]])})
    first, second = mapper(batch), mapper(batch)
    assert first.equals(second)


def test_reused_buffers_give_the_same_ids():
    first = pa.record_batch({"tokens": token_array([[1, 2, 3], [4]])})
    second = pa.record_batch({"tokens": token_array([[5, 6], [EOS, 8]])})
    mapper = NGramIds([LAYOUT, LAYOUT1], reuse_buffers=True)
    for batch in (first, second, first):
        out = mapper(batch)
        assert out.equals(ngram_ids_batch(batch, [LAYOUT, LAYOUT1]))
        address = out.column("ngram_ids_layer0").values.values.buffers()[1].address
        assert address == mapper(batch).column("ngram_ids_layer0").values.values.buffers()[
            1].address


def test_errors_name_the_column():
    good = token_array([[1, 2]])
    cases = [
        ({"tokens": good}, dict(column="text"), ValueError, "'text'"),
        ({"tokens": good}, dict(doc_id_column="doc"), ValueError, "'doc'"),
        ({"tokens": pa.array([[1.5]])}, {}, TypeError, "'tokens'"),
        ({"tokens": pa.array(["a b"])}, {}, TypeError, "'tokens'"),
        ({"tokens": pa.array([[1]], pa.list_(pa.int32(), 1))}, {}, TypeError, "'tokens'"),
        ({"tokens": pa.array([[1], None], pa.list_(pa.int32()))}, {}, ValueError, "null rows"),
        ({"tokens": pa.array([[1, None]], pa.list_(pa.int32()))}, {}, ValueError, "null tokens"),
        ({"tokens": good, "doc": pa.array([None], pa.int64())}, dict(doc_id_column="doc"),
         ValueError, "'doc'"),
        ({"tokens": good, "ngram_ids": [0]}, {}, ValueError, "'ngram_ids' already exists"),
        ({"tokens": good}, dict(device="tpu"), ValueError, "device"),
    ]
    for columns, kwargs, error, words in cases:
        with pytest.raises(error, match=words):
            ngram_ids_batch(pa.record_batch(columns), LAYOUT, **kwargs)
    with pytest.raises(TypeError, match="RecordBatch or Table"):
        ngram_ids_batch({"tokens": [[1]]}, LAYOUT)
    other = nc.layer_layout(nc.NGramConfig(vocab_size=60, ngram_size=3, heads_per_ngram=2,
                                           ngram_vocab_size_base=40, eos_token_id=7), 0)
    with pytest.raises(ValueError, match="same NGramConfig"):
        ngram_ids_batch(pa.record_batch({"tokens": good}), [LAYOUT, other])
    with pytest.raises(ValueError, match="repeat a layer"):
        ngram_ids_batch(pa.record_batch({"tokens": good}), [LAYOUT, LAYOUT])
    with pytest.raises(TypeError, match="LayerLayout"):
        ngram_ids_batch(pa.record_batch({"tokens": good}), CONFIG)


@pytest.mark.gpu
def test_gpu_device_matches_cpu():
    rows, doc_ids = split_documents([list(range(40)), [1, EOS, 2] * 9], [[3, 17], [5]])
    batch = pa.record_batch({"doc": doc_ids, "tokens": token_array(rows)})
    cpu = ngram_ids_batch(batch, [LAYOUT, LAYOUT1], doc_id_column="doc")
    gpu = ngram_ids_batch(batch, [LAYOUT, LAYOUT1], doc_id_column="doc", device="gpu")
    assert gpu.equals(cpu)
