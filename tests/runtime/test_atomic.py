"""Atomic writes: recognisable temporaries, removed on failure, and stale ones cleaned later."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import run_signal_worker

from ngram_cupy.runtime import atomic


def dead_pid() -> int:
    """The id of a process that has exited (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def planted(folder, pid: int, host: str | None = None, name: str = "out.parquet"):
    """A temporary as a killed writer with ``pid`` would have left it."""
    host = host or atomic.host_tag()
    path = folder / f"{atomic.TEMP_PREFIX}{host}-{pid}-0badf00d-{name}"
    path.write_bytes(b"half a file")
    return path


def test_atomic_file_replaces_on_success_and_keeps_the_old_on_failure(tmp_path):
    target = tmp_path / "out.bin"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError), atomic.atomic_file(target) as temporary:
        assert os.path.basename(temporary).startswith(atomic.TEMP_PREFIX)
        with open(temporary, "wb") as f:
            f.write(b"partial")
        raise RuntimeError("writer failed")
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["out.bin"]
    with atomic.atomic_file(target) as temporary, open(temporary, "wb") as f:
        f.write(b"new")
    assert target.read_bytes() == b"new" and os.listdir(tmp_path) == ["out.bin"]


def test_atomic_file_gives_the_umask_permissions(tmp_path):
    umask = os.umask(0o027)
    try:
        with atomic.atomic_file(tmp_path / "x") as temporary:
            os.chmod(temporary, 0o600)  # as safetensors and mkstemp leave it
    finally:
        os.umask(umask)
    assert os.stat(tmp_path / "x").st_mode & 0o777 == 0o640


def test_atomic_file_refuses_a_directory_target_before_writing(tmp_path):
    (tmp_path / "d").mkdir()
    with pytest.raises(IsADirectoryError), atomic.atomic_file(tmp_path / "d"):
        pytest.fail("the block must not run")
    assert os.listdir(tmp_path) == ["d"]


def test_litter_stale_temporaries_of_dead_writers_are_removed_by_the_next_write(tmp_path):
    stale = planted(tmp_path, dead_pid())
    live = planted(tmp_path, os.getpid(), name="mine")
    other_host_fresh = planted(tmp_path, dead_pid(), host="ffffffff", name="other")
    other_host_old = planted(tmp_path, dead_pid(), host="eeeeeeee", name="older")
    old = time.time() - atomic.STALE_SECONDS - 60
    os.utime(other_host_old, (old, old))
    user_file = tmp_path / ".out.parquet.1234.tmp"  # not ours: never touched
    user_file.write_bytes(b"x")
    with atomic.atomic_file(tmp_path / "out.parquet") as temporary, open(temporary, "wb") as f:
        f.write(b"done")
    left = set(os.listdir(tmp_path))
    assert stale.name not in left and other_host_old.name not in left
    assert {live.name, other_host_fresh.name, user_file.name, "out.parquet"} <= left


def test_litter_stale_temporary_folders_are_removed_whole(tmp_path):
    """A whole-folder write (``ngram-cupy quantize``) SIGKILLed leaves a folder: removed with
    its files once its writer is gone; a live writer's folder and a link to a folder stay."""
    stale, live = (tmp_path / planted(tmp_path, pid, name=name).name
                   for pid, name in ((dead_pid(), "q"), (os.getpid(), "mine")))
    for folder in (stale, live):
        folder.unlink()
        (folder / "inner").mkdir(parents=True)
        (folder / "inner" / "model.safetensors").write_bytes(b"rows")
    outside = tmp_path / "kept"
    outside.mkdir()
    link = tmp_path / f"{atomic.TEMP_PREFIX}{atomic.host_tag()}-{dead_pid()}-0badf00d-link"
    link.symlink_to(outside, target_is_directory=True)
    assert atomic.remove_stale_temporaries(tmp_path) == [str(stale)]
    assert sorted(os.listdir(tmp_path)) == sorted([live.name, "kept", link.name])


def test_data_loss_a_fifo_target_is_never_replaced(tmp_path):
    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(FileExistsError, match="not a regular file"), atomic.atomic_file(fifo):
        pytest.fail("the block must not run")
    assert os.listdir(tmp_path) == ["pipe.safetensors"] and not os.path.isfile(fifo)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_litter_a_signal_just_after_the_temporary_appears_removes_it(tmp_path, signum):
    """The CI race of test_cli's interrupted run: a watcher signals as soon as it sees the
    temporary, and the handler runs before the name is handed back. In a process of its own
    (signal_worker.py): the signal never reaches this one (issue 43)."""
    name = signal.Signals(signum).name
    assert run_signal_worker("atomic", signum, tmp_path) == {
        "outcome": f"Interrupted({name})", "left": []}
    assert os.listdir(tmp_path) == []
