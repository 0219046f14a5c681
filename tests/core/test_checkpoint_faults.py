"""Interrupted saves: a kill at any moment leaves the previous or the new checkpoint, and no litter after the next save.

Real processes are killed (SIGKILL, SIGTERM) in the middle of ``fabric.save`` of a large state; a full disk is
a real 2 MiB tmpfs mounted in a private mount namespace (``unshare``; skipped where that is not allowed).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from fabric_core import Fabric
from fabric_core.io.commit import is_temporary, leftovers, new_temp_path, remove_leftovers

SAVER = textwrap.dedent(
    """
    import sys, time
    import torch
    from fabric_core import Fabric
    fabric = Fabric(accelerator="cpu", devices=1)
    state = {"step": int(sys.argv[2]), "w": torch.randn(48 * 1024 * 1024 // 4)}  # 48 MiB
    print("saving", flush=True)
    while True:
        fabric.save(sys.argv[1], state)
    """
)


def _temps(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if is_temporary(p))


def _start_saver(tmp_path: Path, target: Path, step: int) -> subprocess.Popen:
    script = tmp_path / "saver.py"
    script.write_text(SAVER)
    return subprocess.Popen([sys.executable, str(script), str(target), str(step)], stdout=subprocess.PIPE, text=True)


def _kill_while_a_temp_exists(process: subprocess.Popen, folder: Path, signum: int, timeout: float = 60) -> None:
    assert process.stdout.readline().strip() == "saving"
    deadline = time.monotonic() + timeout
    while not _temps(folder):
        assert time.monotonic() < deadline, "the saver never created a temporary file"
        time.sleep(0.002)
    os.kill(process.pid, signum)
    process.wait(timeout=30)


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_killed_save_keeps_the_previous_checkpoint_and_the_next_save_removes_its_temp(tmp_path, signum):
    target = tmp_path / "ckpt" / "last.ckpt"
    fabric = Fabric(accelerator="cpu", devices=1)
    fabric.save(target, {"step": 1, "w": torch.ones(3)}).wait()
    saver = _start_saver(tmp_path, target, step=2)
    _kill_while_a_temp_exists(saver, target.parent, signum)
    assert saver.returncode == -signum
    litter = _temps(target.parent)
    assert litter and all(name.startswith(".last.ckpt.tmp-") for name in litter)  # the kill left a partial file
    # The target is still a complete checkpoint (the old one, or a finished new one), and load never picks a temp.
    assert fabric.load(target)["step"] in (1, 2)
    fabric.save(target, {"step": 3, "w": torch.ones(3)}).wait()  # durable and in place: nothing hidden is left
    assert _temps(target.parent) == []
    assert fabric.load(target)["step"] == 3


LOOP_SAVER = textwrap.dedent(
    """
    import sys
    import torch
    from fabric_core import Fabric
    fabric = Fabric(accelerator="cpu", devices=1)
    w = torch.randn(int(sys.argv[2]) * 1024 * 1024 // 4)
    step = 0
    while True:
        step += 1
        fabric.save(sys.argv[1], {"step": step, "w": w})
        print(step, flush=True)  # this save returned
    """
)


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_kill_at_a_random_moment_never_loses_a_save_that_returned(tmp_path, signum):
    """A process saving in a loop is killed at random moments: the checkpoint at the path is always complete and
    never older than the last save that returned; the next save leaves nothing hidden behind."""
    import random

    script = tmp_path / "loop.py"
    script.write_text(LOOP_SAVER)
    target = tmp_path / "ckpt" / "last.ckpt"
    rng = random.Random(int(signum))
    for attempt in range(6):
        saver = subprocess.Popen([sys.executable, str(script), str(target), "8"], stdout=subprocess.PIPE, text=True)
        assert saver.stdout.readline().strip() == "1"  # at least one save returned
        time.sleep(rng.uniform(0.0, 0.4))
        os.kill(saver.pid, signum)
        rest = saver.stdout.read().split()
        saver.wait(timeout=30)
        last_returned = int(rest[-1]) if rest else 1
        on_disk = torch.load(target, weights_only=True)["step"]  # complete: a torn file would not load
        assert on_disk >= last_returned, (attempt, on_disk, last_returned)
    fabric = Fabric(accelerator="cpu", devices=1)
    fabric.save(target, {"step": 0}).wait()
    assert [p.name for p in target.parent.iterdir()] == ["last.ckpt"]


def test_a_live_writers_temp_is_never_removed(tmp_path):
    """Another process saving the same path right now holds its temp's lock: a save here leaves it alone."""
    target = tmp_path / "shared.ckpt"
    saver = _start_saver(tmp_path, target, step=7)
    try:
        assert saver.stdout.readline().strip() == "saving"
        deadline = time.monotonic() + 60
        seen = set()
        while time.monotonic() < deadline and len(seen) < 3:
            seen.update(_temps(tmp_path))
            assert list(leftovers(target)) == []  # whatever the other writer has open is not a leftover
            time.sleep(0.01)
        assert seen, "the other writer never showed a temporary file"
    finally:
        saver.kill()
        saver.wait(timeout=30)


def test_leftovers_of_other_targets_and_of_live_processes_are_kept(tmp_path):
    target = tmp_path / "a.ckpt"
    dead = tmp_path / f".a.ckpt.tmp-{os.uname().nodename}-999999999-deadbeef"
    dead.write_bytes(b"partial")
    other_target = tmp_path / ".b.ckpt.tmp-host-1-cafe"
    other_target.write_bytes(b"partial")
    ours_alive = new_temp_path(target)  # named after this (live) process, lock not held: spared as in creation
    ours_alive.write_bytes(b"partial")
    live_other = tmp_path / f".a.ckpt.tmp-{os.uname().nodename.replace('-', '_')}-1-feed"  # pid 1 is alive
    live_other.write_bytes(b"partial")
    removed = {p.name for p in remove_leftovers(target)}
    assert dead.name in removed and ours_alive.name in removed  # our own pid: no other thread of ours holds it
    assert other_target.exists() and live_other.exists()


FULL_DISK = textwrap.dedent(
    """
    import errno, os, sys
    import torch
    from fabric_core import Fabric
    folder = sys.argv[1]
    fabric = Fabric(accelerator="cpu", devices=1)
    fabric.save(os.path.join(folder, "ckpt"), {"step": 1, "w": torch.ones(64 * 1024)})   # 256 KiB: fits
    try:
        fabric.save(os.path.join(folder, "ckpt"), {"step": 2, "w": torch.ones(1024 * 1024)})  # 4 MiB: does not
    except OSError as err:
        print("ERRNO", err.errno == errno.ENOSPC, "|", err)
    print("STEP", fabric.load(os.path.join(folder, "ckpt"))["step"])
    print("FILES", sorted(os.listdir(folder)))
    """
)


def test_a_full_disk_says_no_space_left_and_keeps_the_previous_checkpoint(tmp_path):
    script = tmp_path / "full.py"
    script.write_text(FULL_DISK)
    mount = tmp_path / "small"
    mount.mkdir()
    shell = f"mount -t tmpfs -o size=2m tmpfs {mount} && exec {sys.executable} {script} {mount}"
    done = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", shell], capture_output=True, text=True, timeout=120
    )
    if done.returncode != 0 and "mount" in done.stderr and "ERRNO" not in done.stdout:
        pytest.skip(f"cannot mount a small tmpfs in a private namespace here: {done.stderr.strip()[:200]}")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ERRNO True | " in done.stdout and "No space left to save the checkpoint" in done.stdout, done.stdout
    assert "previous checkpoint at that path, if any, is intact" in done.stdout
    assert "STEP 1" in done.stdout and "FILES ['ckpt']" in done.stdout
