"""bench.py: the sections are listed, the GPU ones import without a GPU, nothing tracked is
overwritten unless asked."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import run  # noqa: E402


def test_help_lists_every_section():
    done = subprocess.run([sys.executable, "bench.py", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for bench in run.sections():
        assert bench.name in done.stdout


def test_unknown_sections_exit_2_and_write_nothing(tmp_path):
    target = tmp_path / "out.md"
    assert run.main(["--sections", "nope", "--output", str(target)]) == 2
    assert not target.exists()


def test_outputs_default_beside_the_user_and_the_tracked_file_only_when_asked():
    markdown, png = run.output_paths(run.parse([]))
    assert (markdown, png) == (run.DEFAULT_OUTPUT, "bench-results.png")
    assert run.output_paths(run.parse(["--output", "-"])) == (None, None)
    markdown, png = run.output_paths(run.parse(["--write-benchmarks-md"]))
    assert Path(markdown) == ROOT / "BENCHMARKS.md" and Path(png) == ROOT / "benchmarks.png"


def test_gpu_sections_are_skipped_without_a_gpu(tmp_path, capsys):
    if run.gpu_available():
        return
    assert run.main(["--device", "gpu", "--output", str(tmp_path / "x.md")]) == 2
    assert run.main(["--sections", "ids-gpu,gather-gpu,host-gpu", "--output", "-"]) == 0
    assert capsys.readouterr().out.count("[skip]") == 3


def test_an_output_that_cannot_take_the_report_exits_2_before_running(tmp_path, capsys):
    """A folder, a missing folder, or a file that is not a report (it would be lost): refused
    before any section runs, not with a traceback after minutes of measuring."""
    other = tmp_path / "notes.md"
    other.write_text("my notes\n")
    for output in (tmp_path, tmp_path / "missing" / "out.md", other):
        assert run.main(["--sections", "ids-cpu", "--quick", "--output", str(output)]) == 2
        err = capsys.readouterr()
        assert f"--output {output}" in err.err and "[run]" not in err.out
    assert other.read_text() == "my notes\n"
    assert run.output_problem(None) is None
    assert run.output_problem(str(tmp_path / "new.md")) is None


def test_the_tables_and_the_plot_are_written_after_each_section(tmp_path, monkeypatch):
    """A run cut short (the device check's time box) keeps the figures and plot it measured:
    when the second section starts, the first one's table and plot are on disk."""
    from benchmarks.report import Row, Section

    markdown, png = tmp_path / "out.md", tmp_path / "out.png"
    seen = []

    def first(quick):
        return Section("first", "cpu", rows=[Row("a", 1e-3, tokens=256)])

    def second(quick):
        seen.append((markdown.exists(), png.exists()))
        return Section("second", "cpu", rows=[Row("b", 2e-3, tokens=512)])

    monkeypatch.setattr(run, "sections", lambda: [run.Bench("one", "cpu", "", first),
                                                  run.Bench("two", "cpu", "", second)])
    assert run.main(["--output", str(markdown)]) == 0
    assert seen == [(True, True)] and "first" in markdown.read_text()
