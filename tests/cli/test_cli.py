"""The ngram-cupy command line: results match the library, files are atomic, errors are one line."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import run_cli as run
from helpers import run_signal_worker

import ngram_cupy as nc

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
pytest.importorskip("tqdm")

from ngram_cupy.cli.common import parse_bytes  # noqa: E402
from ngram_cupy.cli.main import main  # noqa: E402
from ngram_cupy.runtime.atomic import TEMP_PREFIX  # noqa: E402
from ngram_cupy.runtime.install_hint import install_hint  # noqa: E402
from ngram_cupy.stats import hottest_rows, ngram_stats, reuse_stats  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "data" / "python_stdlib.parquet"
CONFIG = ROOT / "data" / "config.json"
# A one-head config: streaming tests then cost little beyond reading and writing.
SMALL = dict(vocab_size=248320, eos_token_id=248044, ngram_size=2, heads_per_ngram=1,
             ngram_vocab_size_base=1000)




def run_subprocess(argv: list, **kwargs) -> subprocess.Popen:
    """Start ``python -m ngram_cupy ARGV`` from the repository root."""
    return subprocess.Popen([sys.executable, "-m", "ngram_cupy", *map(str, argv)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=default_interrupt, **kwargs)


def default_interrupt() -> None:
    """SIGINT as a terminal sends it, even under a runner started in the background (ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def small_config_file(tmp_path: Path) -> Path:
    """The one-head config as a file."""
    path = tmp_path / "small.json"
    path.write_text(json.dumps(SMALL))
    return path


def write_tokens(path: Path, row_groups: int, rows: int = 1000, length: int = 500) -> None:
    """A Parquet token file of random valid tokens, ``row_groups`` groups of ``rows`` rows."""
    rng = np.random.default_rng(0)
    schema = pa.schema([("tokens", pa.list_(pa.int32()))])
    offsets = np.arange(0, rows * length + 1, length, dtype=np.int32)
    with pq.ParquetWriter(path, schema) as writer:
        for _ in range(row_groups):
            tokens = rng.integers(0, SMALL["vocab_size"], rows * length, dtype=np.int32)
            writer.write_table(pa.table({"tokens": pa.ListArray.from_arrays(offsets, tokens)}))


def whole_document_ids(layout, table, doc_column: str | None) -> np.ndarray:
    """Ids of every token, each document (a run of rows, or each row) computed whole."""
    rows = table.column("tokens").to_pylist()
    docs = table.column(doc_column).to_pylist() if doc_column else list(range(len(rows)))
    documents: list[list[int]] = []
    for i, row in enumerate(rows):
        if i == 0 or docs[i] != docs[i - 1]:
            documents.append([])
        documents[-1].extend(row)
    tokens = np.array([t for d in documents for t in d], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum([len(d) for d in documents])]).astype(np.int64)
    context = np.full((len(documents), layout.ngram_size - 1), layout.eos_token_id)
    return nc.compute_ngram_ids(layout, tokens, starts, context)


def output_ids(path: Path, column: str = "ngram_ids") -> np.ndarray:
    """All ids of an output file as ``[T, H]``."""
    ids = pq.read_table(path).column(column).combine_chunks()
    return ids.values.values.to_numpy().reshape(len(ids.values), -1)


def test_data_run_matches_library(tmp_path, capsys):
    out = tmp_path / "ids.parquet"
    status, stdout, err = run(["ids", CORPUS, out, "--config", CONFIG,
                               "--doc-id-column", "doc_id"], capsys)
    assert status == 0, err
    assert stdout.startswith(f"wrote {out}: 582 rows, 1,186,603 tokens")
    timed = re.search(r"read, computed and written in ([\d.]+) s .*the whole command ([\d.]+) s",
                      stdout)  # the summary says what it timed, and gives the whole run too
    assert timed and float(timed.group(2)) >= float(timed.group(1)) - 0.05
    result = pq.read_table(out)
    source = pq.read_table(CORPUS)
    assert result.select(source.schema.names).equals(source)
    layout = nc.layer_layout(nc.NGramConfig.from_hf(CONFIG), 0)
    np.testing.assert_array_equal(output_ids(out), whole_document_ids(layout, source, "doc_id"))
    assert os.listdir(tmp_path) == ["ids.parquet"]  # the temporary file is gone


def test_arrow_ipc_inputs_folders_and_several_layers(tmp_path, capsys):
    config = small_config_file(tmp_path)
    table = pq.read_table(CORPUS).slice(100, 40)
    layouts = [nc.layer_layout(nc.NGramConfig.from_hf(config), layer) for layer in (0, 2)]
    expected = [whole_document_ids(layout, table, None) for layout in layouts]
    with pa.ipc.new_file(tmp_path / "in.arrow", table.schema) as writer:
        writer.write_table(table, max_chunksize=7)
    with pa.ipc.new_stream(tmp_path / "in.stream", table.schema) as writer:
        writer.write_table(table, max_chunksize=7)
    (tmp_path / "folder").mkdir()
    pq.write_table(table.slice(0, 25), tmp_path / "folder" / "a.parquet")
    pq.write_table(table.slice(25), tmp_path / "folder" / "b.parquet")
    for source in ("in.arrow", "in.stream", "folder"):
        out = tmp_path / f"{source}.parquet"
        status, _, err = run(["ids", tmp_path / source, out, "--config", config, "--layers", 0,
                              2, "--batch-rows", 5, "--quiet"], capsys)
        assert status == 0, err
        for layer, ids in zip((0, 2), expected, strict=True):
            np.testing.assert_array_equal(output_ids(out, f"ngram_ids_layer{layer}"), ids)


def bad_cases(tmp_path: Path) -> dict[str, list]:
    """Command lines with one user mistake each (the files they name: ``write_bad_files``)."""
    ok = ["--config", CONFIG]
    return {
        "missing input": ["ids", tmp_path / "none.parquet", tmp_path / "o.parquet", *ok],
        "missing output folder": ["ids", CORPUS, tmp_path / "no" / "o.parquet", *ok],
        "not a token file": ["ids", tmp_path / "text.txt", tmp_path / "o.parquet", *ok],
        "output is input": ["ids", CORPUS, CORPUS, *ok],
        "wrong column": ["ids", CORPUS, tmp_path / "o.parquet", *ok, "--column", "text"],
        "column not tokens": ["ids", CORPUS, tmp_path / "o.parquet", *ok, "--column", "source"],
        "wrong doc column": ["ids", CORPUS, tmp_path / "o.parquet", *ok, "--doc-id-column", "d"],
        "missing config": ["ids", CORPUS, tmp_path / "o.parquet", "--config", tmp_path / "x"],
        "bad json config": ["ids", CORPUS, tmp_path / "o.parquet", "--config",
                            tmp_path / "bad.json"],
        "incomplete config": ["layout", "--config", tmp_path / "partial.json"],
        "negative layer": ["ids", CORPUS, tmp_path / "o.parquet", *ok, "--layers", -1],
        "stats wrong column": ["stats", CORPUS, *ok, "--column", "text"],
        "gpu without a device": ["ids", CORPUS, tmp_path / "o.parquet", *ok, "--device", "gpu"],
        "layer beyond the config": ["ids", CORPUS, tmp_path / "o.parquet", "--config",
                                    tmp_path / "two_layers.json", "--layers", 0, 2],
        "stats layer beyond the config": ["stats", CORPUS, "--config",
                                          tmp_path / "two_layers.json", "--layer", 99],
        "output is a directory": ["ids", CORPUS, tmp_path, *ok],
        "text column without tokenizer": ["ids", CORPUS, tmp_path / "o.parquet", *ok,
                                          "--text-column", "text"],
        "hot rows k not a number": ["stats", CORPUS, *ok, "--save-hot-rows", "many",
                                    tmp_path / "hot.npy"],
        "plot over the hot rows": ["stats", CORPUS, *ok, "--save-hot-rows", 5,
                                   tmp_path / "o.parquet", "--plot", tmp_path / "o.parquet"],
    }


def write_bad_files(tmp_path: Path) -> None:
    """A config that is not JSON, one that lacks keys, and a text file."""
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "partial.json").write_text(json.dumps({"vocab_size": 10}))
    (tmp_path / "text.txt").write_text("hello")
    (tmp_path / "two_layers.json").write_text(json.dumps({**SMALL, "ple_layer_ids": [3, 7]}))


@pytest.mark.parametrize("case", list(bad_cases(Path("unused"))))
def test_user_errors_print_one_line_and_exit_2(case, tmp_path, capsys):
    if case == "gpu without a device":
        from conftest import HAS_GPU

        if HAS_GPU:
            pytest.skip("a GPU is present")
    write_bad_files(tmp_path)
    status, stdout, err = run(bad_cases(tmp_path)[case], capsys)
    assert status == 2
    assert err.startswith("ngram-cupy: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err and stdout == ""
    assert not (tmp_path / "o.parquet").exists()
    assert not [name for name in os.listdir(tmp_path) if name.startswith(TEMP_PREFIX)]


def test_user_error_in_a_subprocess_has_no_traceback(tmp_path):
    process = run_subprocess(["ids", CORPUS, tmp_path / "o.parquet", "--config", CONFIG,
                              "--column", "words"])
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 2
    assert stderr == "ngram-cupy: error: token column 'words' not found; columns are " \
                     "['doc_id', 'source', 'chunk', 'text', 'tokens']\n"


def start_slow_run(tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    """A long ``ids`` run in a subprocess, returned once its temporary output exists."""
    source = tmp_path / "big.parquet"
    write_tokens(source, row_groups=10, rows=2000, length=250)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    process = run_subprocess(["ids", source, out_dir / "ids.parquet", "--config",
                              small_config_file(tmp_path), "--batch-rows", 1, "--quiet"])
    deadline = time.monotonic() + 120
    while not os.listdir(out_dir):  # the handshake: a temporary output exists once handlers are set
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "the run never started writing"
        time.sleep(0.02)
    assert process.poll() is None, "the run finished before it could be interrupted"
    return process, out_dir


@pytest.mark.parametrize("signum, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_interrupted_run_leaves_no_files(tmp_path, signum, status):
    process, out_dir = start_slow_run(tmp_path)
    try:
        process.send_signal(signum)
        _, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == status, stderr
    assert "Traceback" not in stderr
    assert os.listdir(out_dir) == []


# (row groups, signal, exit status) of the swallowed-signal runs: one batch, or more to stop early.
SWALLOWED = [(row_groups, signum, status) for row_groups in (1, 3)
             for signum, status in ((signal.SIGINT, 130), (signal.SIGTERM, 143))]


@pytest.fixture(scope="module")
def swallowed_runs(tmp_path_factory) -> dict:
    """Every swallowed-signal run, in one process of their own (signal_worker.py), so that no
    signal they send reaches this one and lands in another test (issue 43)."""
    folder = tmp_path_factory.mktemp("swallowed")
    config = small_config_file(folder)
    cases = []
    for row_groups, signum, _ in SWALLOWED:
        source = folder / f"in-{row_groups}.parquet"
        if not source.exists():
            write_tokens(source, row_groups=row_groups, rows=4, length=50)
        out = folder / f"out-{row_groups}-{signum}" / "ids.parquet"
        out.parent.mkdir()
        cases.append({"signum": int(signum), "argv": ["ids", str(source), str(out), "--config",
                                                     str(config), "--batch-rows", "4"]})
    return dict(zip(SWALLOWED, run_signal_worker("swallowed", json.dumps(cases)), strict=True))


@pytest.mark.parametrize("case", SWALLOWED, ids=lambda case: "-".join(map(str, case)))
def test_a_signal_swallowed_while_compiling_still_stops_the_run(swallowed_runs, case):
    """Numba's compiler drops exceptions raised in its ctypes callbacks: a Ctrl-C handled there
    must still end the run (exit 128 + signal, no output) at the next batch or before commit."""
    _, signum, status = case
    got = swallowed_runs[case]
    assert got["swallowed"] == [signum] and got["calls"] == 1, got
    assert (got["status"], got["stdout"]) == (status, "")
    assert got["stderr"] == f"ngram-cupy: interrupted ({signal.Signals(signum).name})\n"
    assert got["left"] == []


def peak_memory_of_run(tmp_path: Path, row_groups: int) -> int:
    """Peak resident bytes of a fresh process running ``ids`` on a file of ``row_groups``."""
    source = tmp_path / f"rg{row_groups}.parquet"
    write_tokens(source, row_groups)
    argv = ["ids", str(source), str(tmp_path / f"out{row_groups}.parquet"), "--config",
            str(small_config_file(tmp_path)), "--quiet"]
    code = ("import resource, sys\nfrom ngram_cupy.cli.main import main\n"
            f"assert main({argv!r}) == 0\n"
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return int(result.stdout.split()[-1]) * 1024  # Linux reports KiB


def test_peak_memory_does_not_grow_with_file_length(tmp_path):
    small = peak_memory_of_run(tmp_path, row_groups=2)
    large = peak_memory_of_run(tmp_path, row_groups=20)  # 10M tokens: ~120 MB if held whole
    assert large < small + 60 * 2**20, (small, large)


@pytest.mark.parametrize("columns", [120, 0])  # 0: a terminal that reports no width
def test_progress_bar_on_a_terminal(tmp_path, columns):
    source = tmp_path / "in.parquet"
    write_tokens(source, row_groups=3, rows=50, length=100)
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    process = subprocess.Popen(
        [sys.executable, "-m", "ngram_cupy", "ids", str(source), str(tmp_path / "o.parquet"),
         "--config", str(small_config_file(tmp_path)), "--batch-rows", "10"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=terminal)
    os.close(terminal)
    screen = b""
    while True:
        try:
            chunk = os.read(controller, 4096)
        except OSError:  # the terminal closed with the process
            break
        if not chunk:
            break
        screen += chunk
    os.close(controller)
    assert process.wait(timeout=120) == 0
    text = screen.decode(errors="replace")
    assert "150/150" in text and "rows/s" in text and "tokens/s" in text, text


def test_progress_bar_off_without_a_terminal(tmp_path, capsys):
    """In this process: captured stderr is no terminal, as a pipe or a log file is not."""
    source = tmp_path / "in.parquet"
    write_tokens(source, row_groups=3, rows=50, length=100)  # as the terminal test's input
    status, stdout, stderr = run(["ids", source, tmp_path / "o.parquet", "--config",
                                  small_config_file(tmp_path), "--batch-rows", "10"], capsys)
    assert status == 0 and stderr == ""
    assert stdout.startswith("wrote ") and stdout.count("\n") == 1


def test_layout_command_prints_the_released_layout(capsys):
    status, out, _ = run(["layout", "--config", CONFIG], capsys)
    assert status == 0
    for text in ("23703573157769 20109073645365 8052911324071", "320,001,446",
                 "320,001,536", "128 shards", "head_dim 160", "47.7 GiB", "95.4 GiB",
                 "190.7 GiB", "20,000,003"):
        assert text in out, text
    assert len([line for line in out.splitlines() if line.strip().split()[0].isdigit()]) == 16


def test_layout_command_with_budgets_prints_the_placement_plan(capsys):
    status, out, err = run(["layout", "--config", CONFIG, "--gpu-budget", "80GiB",
                            "--host-budget", "100GiB", "--num-layers", 3], capsys)
    assert status == 0, err
    plan = out[out.index("placement of 3 layer table(s) as float8_e4m3fn"):]
    assert "gpu : 1 tables, 47.68 GiB of a 80.00 GiB budget (layer 0)" in plan
    assert "host: 2 tables, 95.37 GiB of a 100.00 GiB budget (layer 1, layer 2)" in plan
    status, out, err = run(["layout", "--config", CONFIG, "--host-budget", "1TB", "--dtype",
                            "float32"], capsys)
    assert status == 0 and "host: 1 tables, 190.74 GiB" in out
    status, out, err = run(["layout", "--config", CONFIG, "--host-budget", "100GiB",
                            "--num-layers", 2, "--processes-per-node", 8], capsys)
    assert status == 0 and "host: 2 tables, 95.37 GiB" in out, err
    assert "one shared copy for 8 processes" in out
    for bad in (["--num-layers", 0], ["--dtype", "int4"], ["--processes-per-node", 0]):
        status, out, err = run(["layout", "--config", CONFIG, "--gpu-budget", "1G", *bad], capsys)
        assert status == 2 and out == "" and err.count("\n") == 1, err


@pytest.mark.parametrize("flag", [["--dtype", "float32"], ["--num-layers", 2],
                                  ["--processes-per-node", 8], ["--tokenizer", "qwen3.5"]])
def test_layout_command_refuses_options_it_would_ignore(flag, capsys):
    """The plan's options without a budget, and the Engram pad id's tokenizer: one line, exit 2,
    nothing printed."""
    status, out, err = run(["layout", "--config", CONFIG, *flag], capsys)
    assert status == 2 and out == "", out
    assert err.startswith(f"ngram-cupy: error: {flag[0]} is only for") and err.count("\n") == 1


def test_stats_command_and_plot(tmp_path, capsys):
    table = pq.read_table(CORPUS).slice(0, 30)
    source = tmp_path / "in.parquet"
    pq.write_table(table, source)
    plot = tmp_path / "stats.png"
    hot = tmp_path / "hot.npy"
    status, out, err = run(["stats", source, "--config", CONFIG, "--doc-id-column", "doc_id",
                            "--plot", plot, "--quiet", "--hot-rows", 10, 1000,
                            "--save-hot-rows", 500, hot], capsys)
    assert status == 0, err
    assert plot.read_bytes().startswith(b"\x89PNG")
    reuse = reuse_stats(table.to_batches(), nc.layer_layout(nc.NGramConfig.from_hf(CONFIG), 0),
                        doc_id_column="doc_id", hot_rows=[10, 1000])
    for k, share in zip((10, 1000), reuse.hit_rates, strict=True):
        assert re.search(rf"^ +{k:,} +[0-9.]+% +{share:.2%}$", out, re.MULTILINE), out
    np.testing.assert_array_equal(np.load(hot), hottest_rows(reuse.all_counts(), 500))
    layout = nc.layer_layout(nc.NGramConfig.from_hf(CONFIG), 0)
    stats, num_tokens = ngram_stats(table.to_batches(), layout, doc_id_column="doc_id")
    assert f"{num_tokens:,} tokens" in out
    lines = out.splitlines()
    for s in stats:
        cells = next(line for line in lines if line.split()[:2] == [str(s.head), str(s.order)])
        assert f"{s.distinct_ngrams:,}" in cells and f"{s.rows_touched:,}" in cells


def test_parse_bytes():
    assert parse_bytes("80GiB") == 80 << 30 == parse_bytes("80G")
    assert parse_bytes("1.5 TB") == 1_500_000_000_000
    assert parse_bytes("4096") == 4096
    with pytest.raises(Exception, match="not a size"):
        parse_bytes("lots")


# --- hostile inputs (issue 9) -------------------------------------------------------------------


def token_folder(tmp_path: Path, second: pa.Table | None = None) -> Path:
    """A corpus folder: a good file ``a.parquet`` and, if given, ``b.parquet``."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    pq.write_table(pa.table({"tokens": pa.array([[1, 2, 3], [4, 5]], pa.list_(pa.int64()))}),
                   folder / "a.parquet")
    if second is not None:
        pq.write_table(second, folder / "b.parquet")
    return folder


def assert_user_error(status: int, stdout: str, err: str, *words: str) -> None:
    """Exit 2, one line on stderr naming ``words``, nothing on stdout."""
    assert status == 2 and stdout == "", (status, stdout, err)
    assert err.startswith("ngram-cupy: error: ") and err.count("\n") == 1, err
    for word in words:
        assert word in err, (word, err)


def test_data_loss_output_inside_the_input_folder_is_refused(tmp_path, capsys):
    folder = token_folder(tmp_path)
    before = (folder / "a.parquet").read_bytes()
    config = small_config_file(tmp_path)
    (tmp_path / "link").symlink_to(folder)
    os.link(folder / "a.parquet", tmp_path / "hard.parquet")
    for output in (folder / "a.parquet", folder / "new.parquet", tmp_path / "link" / "a.parquet",
                   folder / ".." / "corpus" / "sub.parquet", tmp_path / "hard.parquet"):
        status, stdout, err = run(["ids", folder, output, "--config", config], capsys)
        assert_user_error(status, stdout, err, "INPUT")
    assert sorted(os.listdir(folder)) == ["a.parquet"]
    assert (folder / "a.parquet").read_bytes() == before


def test_data_loss_output_is_the_input_file_through_a_link_or_relative_path(tmp_path, capsys,
                                                                            monkeypatch):
    folder = token_folder(tmp_path)
    (tmp_path / "alias.parquet").symlink_to(folder / "a.parquet")
    monkeypatch.chdir(folder)
    for output in (tmp_path / "alias.parquet", "a.parquet", "./../corpus/a.parquet"):
        status, stdout, err = run(["ids", folder / "a.parquet", output, "--config",
                                   small_config_file(tmp_path)], capsys)
        assert_user_error(status, stdout, err, "INPUT")


def test_ugly_output_an_existing_directory_is_refused_before_the_run(tmp_path, capsys):
    (tmp_path / "out").mkdir()
    status, stdout, err = run(["ids", CORPUS, tmp_path / "out", "--config", CONFIG], capsys)
    assert_user_error(status, stdout, err, "directory", "out")
    assert os.listdir(tmp_path / "out") == []


@pytest.mark.parametrize("second, words", [
    (pa.table({"tokens": pa.array([["a", "b"]], pa.list_(pa.string()))}), ["string"]),
    (pa.table({"tokens": pa.array([[1.7, 2.2]], pa.list_(pa.float64()))}), ["double"]),
    (pa.table({"text": pa.array(["no tokens here"])}), ["'tokens' not found"]),
], ids=["list<string>", "list<double>", "no token column"])
def test_silent_wrong_folder_file_with_wrong_tokens_names_file_and_column(tmp_path, capsys,
                                                                          second, words):
    folder = token_folder(tmp_path, second)
    out = tmp_path / "o.parquet"
    for argv in (["ids", folder, out], ["stats", folder]):
        status, stdout, err = run([*argv, "--config", small_config_file(tmp_path)], capsys)
        assert_user_error(status, stdout, err, "b.parquet", "tokens", *words)
    assert not out.exists()


def test_folder_files_with_int32_and_int64_tokens_and_extra_columns_are_read_whole(tmp_path,
                                                                                   capsys):
    second = pa.table({"tokens": pa.array([[2**40 + 7, 9]], pa.list_(pa.int64())),
                       "source": pa.array(["b"])})
    folder = tmp_path / "corpus"
    folder.mkdir()
    pq.write_table(pa.table({"tokens": pa.array([[1, 2, 3]], pa.list_(pa.int32()))}),
                   folder / "a.parquet")
    pq.write_table(second, folder / "b.parquet")
    out = tmp_path / "o.parquet"
    status, _, err = run(["ids", folder, out, "--config", small_config_file(tmp_path), "--quiet"],
                         capsys)
    assert status == 0, err
    table = pq.read_table(out)
    assert table.column("tokens").to_pylist() == [[1, 2, 3], [2**40 + 7, 9]]
    assert table.column("source").to_pylist() == [None, "b"]
    layout = nc.layer_layout(nc.NGramConfig(**SMALL), 0)
    np.testing.assert_array_equal(output_ids(out), whole_document_ids(layout, table, None))


def test_killed_run_leaves_no_output_and_its_temporary_goes_with_the_next_run(tmp_path, capsys):
    process, out_dir = start_slow_run(tmp_path)
    process.kill()
    process.communicate(timeout=60)
    assert process.returncode == -signal.SIGKILL
    (left,) = os.listdir(out_dir)  # no ids.parquet: only the temporary a SIGKILL cannot remove
    assert left.startswith(TEMP_PREFIX)
    source = tmp_path / "small.parquet"  # any next run into the folder: a small one
    write_tokens(source, row_groups=1, rows=10, length=50)
    status, _, err = run(["ids", source, out_dir / "other.parquet", "--config",
                          small_config_file(tmp_path), "--quiet"], capsys)
    assert status == 0, err
    assert os.listdir(out_dir) == ["other.parquet"]


@pytest.mark.parametrize("field, value", [("heads_per_ngram", 1_000_000),
                                          ("ngram_size", 100_000)])
def test_hang_layout_of_a_huge_config_is_refused_at_once(tmp_path, capsys, field, value):
    config = tmp_path / "huge.json"
    config.write_text(json.dumps({**SMALL, field: value}))
    status, stdout, err = run(["layout", "--config", config], capsys)
    assert_user_error(status, stdout, err, field, str(value))


def test_data_loss_output_a_fifo_or_device_is_never_replaced(tmp_path, capsys):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    status, stdout, err = run(["ids", CORPUS, fifo, "--config", CONFIG], capsys)
    assert_user_error(status, stdout, err, "not a regular file")
    assert os.path.exists(fifo) and not os.path.isfile(fifo)


def test_hang_input_a_fifo_is_refused_without_reading(tmp_path, capsys):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)  # opening it to read would wait for a writer forever
    status, stdout, err = run(["ids", fifo, tmp_path / "o.parquet", "--config", CONFIG], capsys)
    assert_user_error(status, stdout, err, "not a regular file")


def test_ugly_output_with_a_trailing_slash_is_a_directory(tmp_path, capsys):
    status, stdout, err = run(["ids", CORPUS, f"{tmp_path}/new/", "--config", CONFIG], capsys)
    assert_user_error(status, stdout, err, "directory")
    assert os.listdir(tmp_path) == []


def test_ugly_usage_mistakes_are_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["layout", "--config", str(CONFIG), "--gpu-budget", "nan"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a size" in err, err


# --- third hostile trial and a newcomer's frictions (issue 23) ----------------------------------


def test_ugly_a_400_digit_budget_is_one_line(capsys):
    for budget in ("9" * 400, "9" * 30 + "TiB", f"{2**63}"):
        with pytest.raises(SystemExit) as exit_:
            main(["layout", "--config", str(CONFIG), "--gpu-budget", budget])
        captured = capsys.readouterr()
        assert exit_.value.code == 2 and captured.out == "", captured
        assert captured.err.startswith("ngram-cupy layout: error: argument --gpu-budget: not a "
                                       "size") and captured.err.count("\n") == 1, captured.err
    assert parse_bytes("0.5k") == 512 and parse_bytes(str(2**63 - 1)) == 2**63 - 1


def unwritable(monkeypatch, folder: Path) -> None:
    """``folder`` not writable: by its mode for an ordinary user; for root, who writes anyway,
    as a read-only file system answers (EROFS)."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        return
    real = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, *a, **k: False if os.path.samefile(
        path, folder) and mode & os.W_OK else real(path, mode, *a, **k))


@pytest.mark.parametrize("folder", ["missing", "read-only"])
def test_ugly_unwritable_output_folder_is_refused_before_compiling_or_running(
        tmp_path, capsys, monkeypatch, folder):
    import ngram_cupy.cli.ids as cli
    import ngram_cupy.stats as stats

    out = tmp_path / "out"
    if folder == "read-only":
        out.mkdir()
        unwritable(monkeypatch, out)
    work = []
    monkeypatch.setattr(cli, "compile_kernels", lambda *args: work.append("compile") or 0.0)
    monkeypatch.setattr(stats, "ngram_stats", lambda *args: work.append("stats"))
    small = ["--config", small_config_file(tmp_path), "--quiet"]
    for command in (["ids", CORPUS, out / "ids.parquet"],
                    ["stats", CORPUS, "--plot", out / "stats.png"],
                    ["stats", CORPUS, "--save-hot-rows", 10, out / "hot.npy"]):
        status, stdout, err = run([*command, *small], capsys)
        assert_user_error(status, stdout, err, str(out))
        assert ("not writable" if folder == "read-only" else "does not exist") in err
    assert work == []


def test_version_and_info(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out == f"ngram-cupy {nc.__version__}\n"
    status, out, err = run(["info"], capsys)
    assert status == 0, err
    import numba

    from ngram_cupy.runtime.cpu_threads import threading_layer

    lines = out.splitlines()
    assert lines[0].startswith(f"ngram-cupy {nc.__version__} (Python ")
    assert lines[1] == (f"CPU: {numba.get_num_threads()} threads of {os.cpu_count()} cores, "
                        f"Numba threading layer {threading_layer()}")
    assert lines[2].startswith("GPU: ")
    assert lines[3].startswith("kernel cache folder: ")


def test_info_names_the_kernel_cache_folder(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)  # whatever the caller's environment
    monkeypatch.setenv("NGRAM_CUPY_CACHE_DIR", str(tmp_path / "kernels"))
    assert run(["info"], capsys)[1].splitlines()[-1] == (
        f"kernel cache folder: {tmp_path / 'kernels'} (set by NGRAM_CUPY_CACHE_DIR)")
    monkeypatch.delenv("NGRAM_CUPY_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert run(["info"], capsys)[1].splitlines()[-1] == (
        f"kernel cache folder: {tmp_path / '.cache' / 'ngram_cupy'} (default; set "
        "NGRAM_CUPY_CACHE_DIR)")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert run(["info"], capsys)[1].splitlines()[-1] == (
        f"kernel cache folder: {tmp_path / 'xdg' / 'ngram_cupy'} (default; set "
        "NGRAM_CUPY_CACHE_DIR)")


def test_compile_list_prints_the_kernel_names_and_builds_none(capsys, monkeypatch):
    from ngram_cupy.ids.kernel_set import SCHEMES, kernel_variants
    from ngram_cupy.runtime import kernel_cache

    monkeypatch.setattr(kernel_cache.KERNELS, "fetch", None)  # any build would fail here
    status, stdout, _ = run(["compile", "--list"], capsys)
    names = [variant.name for variant in kernel_variants([SCHEMES["released"]])]
    assert status == 0 and stdout.splitlines() == names and len(names) > 3
    status, stdout, _ = run(["compile", "--list", "--only", names[0]], capsys)
    assert status == 0 and names[0] in stdout.splitlines()


def test_every_argument_has_help():
    import argparse

    from ngram_cupy.cli.main import build_parser

    def arguments(parser):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    yield from arguments(sub)
            elif not isinstance(action, argparse._HelpAction):
                yield parser.prog, action

    missing = [(prog, action.dest) for prog, action in arguments(build_parser())
               if not action.help]
    assert missing == []


def test_output_records_layers_config_hash_and_version(tmp_path, capsys):
    from ngram_cupy.arrow import config_hash

    config = small_config_file(tmp_path)
    source = tmp_path / "in.parquet"
    pq.write_table(pq.read_table(CORPUS).slice(0, 5), source)
    for layers, columns in (([0], ["ngram_ids"]), ([0, 2], ["ngram_ids_layer0",
                                                            "ngram_ids_layer2"])):
        out = tmp_path / f"{len(layers)}.parquet"
        status, _, err = run(["ids", source, out, "--config", config, "--layers", *layers,
                              "--quiet"], capsys)
        assert status == 0, err
        record = json.loads(pq.read_schema(out).metadata[b"ngram_cupy"])
        loaded = nc.NGramConfig.from_hf(config)
        assert record["version"] == nc.__version__
        assert record["config_hash"] == config_hash(loaded)
        assert nc.NGramConfig.from_hf(record["config"]) == loaded
        assert record["token_column"] == "tokens"
        assert record["layers"] == [{"column": c, "layer": layer}
                                    for c, layer in zip(columns, layers, strict=True)]
    other = nc.NGramConfig(**{**SMALL, "seed": 1})
    assert config_hash(other) != config_hash(nc.NGramConfig.from_hf(config))


def test_out_of_vocabulary_and_negative_tokens_are_hashed_and_counted(tmp_path, capsys):
    config = small_config_file(tmp_path)
    vocab = SMALL["vocab_size"]
    tokens = [[1, -5, 2], [vocab, vocab + 7, 3], [4]]
    source = tmp_path / "in.parquet"
    pq.write_table(pa.table({"tokens": pa.array(tokens, pa.list_(pa.int64()))}), source)
    out = tmp_path / "ids.parquet"
    status, stdout, err = run(["ids", source, out, "--config", config], capsys)
    assert status == 0, err
    assert f"note: 3 token(s) lie outside the vocabulary [0, {vocab:,})" in stdout
    layout = nc.layer_layout(nc.NGramConfig.from_hf(config), 0)
    table = pq.read_table(source)
    np.testing.assert_array_equal(output_ids(out), whole_document_ids(layout, table, None))
    pq.write_table(pa.table({"tokens": pa.array([[1, 2]], pa.list_(pa.int64()))}), source)
    assert "note:" not in run(["ids", source, out, "--config", config], capsys)[1]


def test_ugly_missing_pyarrow_gives_the_extra_to_install(tmp_path):
    script = ("import sys; sys.modules['pyarrow'] = None\n"
              "from ngram_cupy.cli.main import main\n"
              f"sys.exit(main(['ids', {str(CORPUS)!r}, {str(tmp_path / 'o.parquet')!r}, "
              f"'--config', {str(CONFIG)!r}]))")
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr == ("ngram-cupy: error: ngram_cupy.arrow needs pyarrow: "
                             f"{install_hint('arrow')}\n")
    assert "pip install -e '.[arrow]'" in result.stderr  # from a clone: not on the index


def test_a_negative_layer_is_named_as_such_not_as_a_prime_limit(tmp_path, capsys):
    write_bad_files(tmp_path)
    status, stdout, err = run(["layout", "--config", tmp_path / "two_layers.json", "--layer", -1],
                              capsys)
    assert status == 2 and stdout == ""
    assert "layer -1 is not a PLE layer: layers are counted from 0 (0..1)" in err, err
