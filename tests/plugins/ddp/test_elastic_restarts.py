"""``fabric run --max-restarts``: a failed rank restarts every worker, up to the limit, with torchrun's agent."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from jobs import fabric_command, free_port, run_job

pytestmark = [pytest.mark.multiprocess, pytest.mark.skipif(sys.platform != "linux", reason="uses /proc")]

FLAKY = Path(__file__).parent / "scripts" / "flaky_rank.py"
TIMEOUT = 240  # three attempts of two torch processes on a loaded 2-core machine


def _run(tmp_path: Path, *options: str, fails: int) -> tuple[int, str]:
    command = [*fabric_command(), "--accelerator", "cpu", "--devices", "2", *options, FLAKY, tmp_path, fails]
    job, code = run_job([str(c) for c in command], tmp_path / "log.txt", TIMEOUT)
    return code, job.output()


def _attempts(tmp_path: Path) -> set[str]:
    return {p.name for p in tmp_path.glob("attempt*-rank*")}


def test_a_failed_rank_restarts_the_workers_until_they_succeed(tmp_path: Path):
    code, output = _run(tmp_path, "--main-port", str(free_port()), "--max-restarts", "2", fails=2)
    assert code == 0, output[-4000:]
    assert _attempts(tmp_path) == {f"attempt{a}-rank{r}" for a in range(3) for r in range(2)}
    assert (tmp_path / "result").read_text() == "4"  # both ranks of attempt 2 met in the all_reduce
    assert "rank 1 fails in attempt 1 on purpose" in output  # each failure is still shown


def test_past_max_restarts_the_job_fails_with_the_last_attempts_error(tmp_path: Path):
    code, output = _run(tmp_path, "--main-port", str(free_port()), "--max_restarts", "1", fails=2)
    assert code == 1, output[-4000:]
    assert _attempts(tmp_path) == {f"attempt{a}-rank{r}" for a in range(2) for r in range(2)}
    assert not (tmp_path / "result").exists()
    first = next(line for line in reversed(output.splitlines()) if "First failure:" in line)
    assert "Rank 1 (local rank 1" in first and "rank 1 fails in attempt 1 on purpose" in first


def test_standalone_rendezvous_with_logs_teed_to_a_folder(tmp_path: Path):
    logs = tmp_path / "logs"
    code, output = _run(tmp_path, "--standalone", "--max-restarts", "1", "--tee", "3", "--log-dir", str(logs), fails=1)
    assert code == 0, output[-4000:]
    assert (tmp_path / "result").read_text() == "2"
    stderr_logs = {p.relative_to(logs).parts[-3:] for p in logs.rglob("stderr.log")}
    assert stderr_logs == {(f"attempt_{a}", str(r), "stderr.log") for a in (0, 1) for r in (0, 1)}
    failed_log = next(logs.rglob("attempt_0/1/stderr.log")).read_text()
    assert "rank 1 fails in attempt 0 on purpose" in failed_log
