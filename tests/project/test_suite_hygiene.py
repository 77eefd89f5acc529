"""The suite's own conduct (issue 43): a run leaves no folder in /dev/shm whatever its outcome,
and no test sends its own process a signal (one could land in another test)."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
# Calls that signal the calling process (``os.kill`` counts when given ``os.getpid()``).
SELF_SIGNALS = {"raise_signal", "pthread_kill", "interrupt_main"}
# A segment scope folder a test module makes itself (conftest's shm_root and shm_dir make
# them, and remove them).
OWN_SCOPES = re.compile(r"mkdtemp\([^)]*ngram_cupy-test-")


def suite_files() -> list[Path]:
    """Every Python file of the suite but this one."""
    return [path for path in sorted(TESTS.rglob("*.py")) if path != Path(__file__).resolve()]


def test_a_failing_run_leaves_no_shared_memory_folder(tmp_path):
    """A run whose test fails and leaves a folder in its session's shm_root: at the end of the
    session the root is gone with everything in it."""
    (tmp_path / "test_fails.py").write_text(textwrap.dedent("""
        import tempfile

        def test_fails(shm_root, shm_dir):
            left = tempfile.mkdtemp(dir=shm_root)  # as a test making its own scope would
            print("LEFT", left, shm_dir)
            raise AssertionError("meant to fail")
    """))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS)])}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                          "-p", "conftest", "--rootdir", str(tmp_path), "test_fails.py"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "1 failed" in run.stdout, run.stdout + run.stderr
    left, scope = re.search(r"^LEFT (\S+) (\S+)", run.stdout, re.M).groups()
    root = Path(left).parent
    assert root.name.startswith("ngram_cupy-test-") and Path(scope).parent == root
    assert not root.exists(), sorted(os.listdir(root))


def signals_itself(node: ast.AST) -> bool:
    """Whether ``node`` is a call that signals the calling process."""
    if not isinstance(node, ast.Call):
        return False
    name = getattr(node.func, "attr", getattr(node.func, "id", ""))
    return name in SELF_SIGNALS or (name == "kill" and "getpid" in ast.dump(node))


def test_no_test_signals_its_own_process():
    """Tests that need a signal send it in a process of their own (tests/signal_worker.py);
    code in strings run by a subprocess is not this process's."""
    found = [f"{path.relative_to(ROOT)}:{node.lineno}" for path in suite_files()
             if path.name != "signal_worker.py"
             for node in ast.walk(ast.parse(path.read_text())) if signals_itself(node)]
    assert not found, found


def test_no_test_makes_its_own_shared_memory_folder():
    """Segment scopes come from conftest's shm_dir, whose root goes at the session's end."""
    found = [str(path.relative_to(ROOT)) for path in suite_files()
             if path.name != "conftest.py" and OWN_SCOPES.search(path.read_text())]
    assert not found, found


# A program's entry point: each script a test starts in a process of its own has one.
ENTRY_POINT = "main"


def helper_definitions(sources: dict[str, str]) -> dict[str, list[str]]:
    """Where each helper (a module-level function or class that is not a test) is defined:
    name -> the files, of ``sources`` (file -> its text)."""
    found: dict[str, list[str]] = {}
    for file, source in sources.items():
        for node in ast.parse(source).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and \
                    not node.name.startswith(("test_", "Test")) and node.name != ENTRY_POINT:
                found.setdefault(node.name, []).append(file)
    return found


def test_each_helper_is_defined_once():
    """A helper two test modules need lives in conftest.py or a tests/ helper module; two
    helpers of different meaning have different names (so that neither is taken for the
    other)."""
    sample = {"a.py": "def shared(): pass\ndef test_x(): pass\ndef main(): pass\n",
              "b.py": "class shared: pass\ndef test_x(): pass\ndef main(): pass\n"}
    assert helper_definitions(sample) == {"shared": ["a.py", "b.py"]}
    sources = {str(path.relative_to(TESTS)): path.read_text(encoding="utf-8")
               for path in sorted(TESTS.rglob("*.py"))}
    repeated = {name: files for name, files in helper_definitions(sources).items()
                if len(files) > 1}
    assert not repeated, "helpers defined more than once:\n" + "\n".join(
        f"{name}: {', '.join(files)}" for name, files in sorted(repeated.items()))
