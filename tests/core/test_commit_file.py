"""``fabric_core.io.commit_file`` and a one-process ``commit_directory``: the crash-safe writers a format uses for a
file or a folder that is not a ``torch.save`` (``numpy.savez``, JSON, a copy). A writer that fails (or is
interrupted) leaves the previous file whole and no temporary one; a process killed while writing leaves the previous
file, and the next write removes what it left."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fabric_core.io import CheckpointLocation, commit_directory, commit_file
from fabric_core.io.commit import is_temporary


def _temps(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if is_temporary(p))


def test_a_file_is_replaced_whole_and_a_failed_write_keeps_the_previous_one(tmp_path: Path):
    target = tmp_path / "sub" / "state.json"
    commit_file(target, lambda file: file.write(json.dumps({"step": 1}).encode()))
    assert json.loads(target.read_text()) == {"step": 1} and _temps(target.parent) == []

    def half_then_fail(file):
        file.write(b'{"step": 2, "tru')
        raise KeyboardInterrupt  # not even an Exception: the temporary file goes all the same

    with pytest.raises(KeyboardInterrupt):
        commit_file(target, half_then_fail)
    assert json.loads(target.read_text()) == {"step": 1} and _temps(target.parent) == []

    commit_file(CheckpointLocation.of(target), lambda file: file.write(b'{"step": 3}'))
    assert json.loads(target.read_text()) == {"step": 3}


def test_a_writer_that_seeks_works(tmp_path: Path):
    """Zip writers (``numpy.savez``, ``zipfile``) seek back to fill in headers: the local file allows it."""
    import zipfile

    target = tmp_path / "archive.zip"

    def write(file):
        with zipfile.ZipFile(file, "w") as archive:
            archive.writestr("a.txt", "hello")

    commit_file(target, write)
    assert zipfile.ZipFile(target).read("a.txt") == b"hello"


def test_at_a_url_the_file_is_one_upload(tmp_path: Path):
    pytest.importorskip("fsspec")
    url = "memory://commit-file-test/state.bin"
    commit_file(url, lambda file: file.write(b"abc"))
    location = CheckpointLocation.of(url)
    assert location.read_bytes() == b"abc"
    location.remove()


_KILLED_WRITER = textwrap.dedent(
    """
    import sys, time
    from fabric_core.io import commit_file
    def write(file):
        file.write(b"new" * 1000)
        print("writing", flush=True)
        time.sleep(600)
    commit_file(sys.argv[1], write)
    """
)


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_killed_writer_leaves_the_previous_file_and_the_next_write_removes_its_temp(tmp_path: Path, signum: int):
    target = tmp_path / "state.bin"
    commit_file(target, lambda file: file.write(b"old"))
    writer = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(target)], stdout=subprocess.PIPE, text=True)
    assert writer.stdout.readline().strip() == "writing"
    writer.send_signal(signum)
    assert writer.wait(timeout=30) == -signum
    assert target.read_bytes() == b"old" and _temps(tmp_path), "the kill left its temporary file"
    commit_file(target, lambda file: file.write(b"next"))
    assert target.read_bytes() == b"next" and _temps(tmp_path) == []


def test_one_process_commits_a_folder_without_a_coordinator(tmp_path: Path):
    source = tmp_path / "source"
    (source / "inner").mkdir(parents=True)
    (source / "inner" / "x.txt").write_text("x")
    target = tmp_path / "copy"
    target.mkdir()
    (target / "old.txt").write_text("old")  # the previous copy: replaced as a whole

    commit_directory(target, lambda folder: shutil.copytree(source, folder.path, dirs_exist_ok=True))
    assert sorted(p.relative_to(target).as_posix() for p in target.rglob("*")) == ["inner", "inner/x.txt"]

    def fail(folder):
        (folder.path / "partial").write_text("p")
        raise OSError("disk went away")

    with pytest.raises(OSError, match="disk went away"):
        commit_directory(target, fail)
    assert (target / "inner" / "x.txt").read_text() == "x" and not (target / "partial").exists()
    assert _temps(tmp_path) == []
