"""A failing, interrupted or killed rank ends the whole job promptly, with a non-zero exit and no orphans.

The jobs run ``scripts/crash.py``. "Promptly" is measured from the moment the failing rank raises (it writes the
time to ``raised_at``) to the moment the job's main process has exited.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest
from jobs import fabric_command, free_port, is_alive, start_job, wait_until

SCRIPTS = Path(__file__).parent / "scripts"

pytestmark = [pytest.mark.multiprocess, pytest.mark.skipif(sys.platform != "linux", reason="uses /proc")]

CRASH = SCRIPTS / "crash.py"
START_TIMEOUT = 180  # starting two torch processes on a loaded 2-core machine
PROMPT = 30  # a failure must end the job within this many seconds


def _pids(outdir: Path) -> list[int]:
    return [int((outdir / f"pid{r}").read_text()) for r in (0, 1)]


def _run_failing(command: list, outdir: Path) -> tuple[int, float, str, list[int]]:
    """Run a job that fails on purpose; return its code, seconds from the failure to its end, output, leftovers."""
    job = start_job(command, outdir / "log.txt")
    code = job.wait(START_TIMEOUT + PROMPT)
    ended = time.time()
    assert (outdir / "raised_at").exists(), job.output()[-4000:]
    latency = ended - float((outdir / "raised_at").read_text())
    return code, latency, job.output(), job.leftovers()


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("child_raises", "rank 1 fails on purpose"),
        ("parent_raises", "rank 0 fails on purpose"),
        # Rank 0 is done: its process waits for the children and still reports their failure.
        ("late_child_failure", "rank 1 fails on purpose, after rank 0 is done"),
        # Rank 0 is done while rank 1 waits for it in a collective: the job must end, not wait for a timeout.
        ("unmatched_collective", "Local rank 1"),
    ],
)
def test_failing_rank_ends_subprocess_job(tmp_path: Path, mode: str, expected: str):
    code, latency, output, leftovers = _run_failing([sys.executable, CRASH, mode, tmp_path], tmp_path)
    assert code == 1, output[-4000:]
    assert latency < PROMPT, f"the job needed {latency:.1f} s to end after the failure"
    assert expected in output
    assert not leftovers
    assert not any(is_alive(pid) for pid in _pids(tmp_path))


def test_failing_worker_raises_in_fork_caller(tmp_path: Path):
    code, latency, output, leftovers = _run_failing(
        [sys.executable, CRASH, "fork_child_raises", tmp_path], tmp_path
    )
    assert code == 1, output[-4000:]
    assert latency < PROMPT
    assert "ProcessRaisedException" in output and "rank 1 fails on purpose" in output
    assert not leftovers


def test_failing_rank_ends_fabric_run(tmp_path: Path):
    command = [*fabric_command(), "--accelerator", "cpu", "--devices", "2", "--main-port", free_port()]
    code, latency, output, leftovers = _run_failing([*command, CRASH, "cli_child_raises", tmp_path], tmp_path)
    assert code != 0, output[-4000:]
    assert latency < PROMPT
    assert "rank 1 fails on purpose" in output
    assert not leftovers


def _start_stuck(outdir: Path):
    """A job whose two ranks are blocked inside a C++ receive that never completes."""
    job = start_job([sys.executable, CRASH, "stuck", outdir], outdir / "log.txt")
    ready = wait_until(
        lambda: (
            (outdir / "ready0").exists() and (outdir / "ready1").exists() or job.process.poll() is not None
        ),
        START_TIMEOUT,
    )
    assert ready and job.process.poll() is None, job.output()[-4000:]
    time.sleep(0.3)  # both ranks are now inside the receive
    return job


def test_sigterm_to_parent_ends_every_rank(tmp_path: Path):
    job = _start_stuck(tmp_path)
    sent = time.monotonic()
    job.process.send_signal(signal.SIGTERM)
    code = job.wait(PROMPT)
    assert time.monotonic() - sent < PROMPT
    assert code in (128 + signal.SIGTERM, -signal.SIGTERM), job.output()[-4000:]
    assert not job.leftovers()
    assert not any(is_alive(pid) for pid in _pids(tmp_path))


def test_second_sigint_ends_every_rank(tmp_path: Path):
    """The first Ctrl-C is forwarded (KeyboardInterrupt); ranks stuck in C++ ignore it, so a second one ends all."""
    job = _start_stuck(tmp_path)
    job.process.send_signal(signal.SIGINT)
    assert wait_until(lambda: "press Ctrl-C again" in job.output(), 10), job.output()[-4000:]
    assert job.process.poll() is None
    job.process.send_signal(signal.SIGINT)
    assert job.wait(PROMPT) == 128 + signal.SIGINT
    assert not job.leftovers()


def test_children_die_with_a_killed_parent(tmp_path: Path):
    """SIGKILL gives the parent no chance to clean up: the kernel ends the children (PR_SET_PDEATHSIG)."""
    job = _start_stuck(tmp_path)
    child = _pids(tmp_path)[1]
    job.process.kill()
    job.wait(PROMPT)
    assert wait_until(lambda: not is_alive(child), PROMPT), "local rank 1 outlived its killed parent"
    assert not job.leftovers()


@pytest.mark.parametrize(("mode", "code"), [("child_exits_hard", 7), ("child_killed", 128 + signal.SIGKILL)])
def test_a_rank_that_dies_hard_is_named_and_its_code_is_the_jobs(tmp_path: Path, mode: str, code: int):
    """Rank 0 fails in its collective because rank 1 died: the report names rank 1 and the job exits with its code."""
    got, latency, output, leftovers = _run_failing([sys.executable, CRASH, mode, tmp_path], tmp_path)
    assert got == code, output[-4000:]
    assert latency < PROMPT
    assert f"Local rank 1 (pid {_pids(tmp_path)[1]}) exited with code {code}" in output
    assert not leftovers


def test_sigint_to_the_caller_of_a_spawn_job_ends_it(tmp_path: Path):
    job = start_job([sys.executable, CRASH, "spawn_stuck", tmp_path], tmp_path / "log.txt")
    ready = wait_until(lambda: (tmp_path / "ready0").exists() and (tmp_path / "ready1").exists(), START_TIMEOUT)
    assert ready, job.output()[-4000:]
    time.sleep(0.3)
    job.process.send_signal(signal.SIGINT)  # to the caller only, as `kill -INT` does
    code = job.wait(PROMPT)
    assert code != 0 and "KeyboardInterrupt" in job.output(), job.output()[-4000:]
    assert not job.leftovers()
    assert not any(is_alive(pid) for pid in _pids(tmp_path))


def test_rank_zero_first_waits_longer_than_the_collective_timeout(tmp_path: Path):
    job = start_job([sys.executable, CRASH, "zero_first_slow", tmp_path], tmp_path / "log.txt")
    assert job.wait(START_TIMEOUT) == 0, job.output()[-4000:]
    assert (tmp_path / "done0").exists() and (tmp_path / "done1").exists()
    assert not job.leftovers()


def test_rank_zero_first_failure_of_rank_zero_ends_the_job_promptly(tmp_path: Path):
    code, latency, output, leftovers = _run_failing([sys.executable, CRASH, "zero_first_fails", tmp_path], tmp_path)
    assert code != 0 and "rank 0 fails inside rank_zero_first on purpose" in output, output[-4000:]
    assert latency < PROMPT
    assert not leftovers


def test_mismatched_collectives_are_refused_on_every_rank(tmp_path: Path):
    job = start_job([sys.executable, CRASH, "mismatched", tmp_path], tmp_path / "log.txt")
    assert job.wait(START_TIMEOUT) == 0, job.output()[-4000:]
    for rank in (0, 1):
        errors = (tmp_path / f"errors{rank}").read_text()
        assert "`all_reduce` needs a tensor of the same shape on every rank, got rank 0: (2,), rank 1: (3,)" in errors
        assert "`broadcast(src=5)`: `src` must be a rank between 0 and 1" in errors


RENDEZVOUS_DEATH = SCRIPTS / "rendezvous_death.py"


@pytest.mark.parametrize(
    ("launcher", "where"),
    [("script", "before"), ("script", "during"), ("script", "after"), ("spawn", "after"), ("cli", "before"), ("cli", "after")],
)
def test_a_rank_dying_in_the_rendezvous_is_named_last_with_its_own_error(tmp_path: Path, launcher: str, where: str):
    """Rank 1 raises while the ranks meet. Whatever rank 0 reports after it ("Connection closed by peer"), the job's
    last lines name rank 1 as the first failure and quote its own error, and the job exits with its code."""
    command = [sys.executable, RENDEZVOUS_DEATH, launcher, where, tmp_path]
    if launcher == "cli":
        command = [*fabric_command(), "--accelerator", "cpu", "--devices", "2", "--main-port", free_port(), *command[1:]]
    code, latency, output, leftovers = _run_failing(command, tmp_path)
    assert code == 1, output[-4000:]
    assert latency < PROMPT
    assert not leftovers
    own_error = f"rank 1 dies during the rendezvous ({where}) on purpose"
    last_lines = "\n".join(output.strip().splitlines()[-12:])
    assert own_error in last_lines, output[-4000:]
    if launcher == "spawn":
        assert "-- Process 1 terminated with the following error" in output, output[-4000:]
    else:
        first = next(line for line in reversed(output.splitlines()) if "First failure:" in line)
        assert ("Local rank 1" if launcher == "script" else "Rank 1 (local rank 1") in first, first
