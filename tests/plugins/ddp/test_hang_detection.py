"""FABRIC_HANG_TIMEOUT: a rank stuck in user code ends the job within seconds, named, with its line and stack."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from jobs import fabric_command, free_port, job_env, run_job

from fabric_core.runtime import hang

pytestmark = [pytest.mark.skipif(sys.platform != "linux", reason="uses /proc")]

HANG = Path(__file__).parent / "scripts" / "hang.py"
STUCK_LINE = next(i for i, line in enumerate(HANG.read_text().splitlines(), 1) if line.strip() == "time.sleep(600)  # STUCK HERE")
LIMIT = 5
WITHIN = 20  # seconds from the moment the rank gets stuck to the end of the job
START_TIMEOUT = 180


def _run(tmp_path: Path, launcher: str, stuck: int) -> tuple[int, str]:
    if launcher == "cli":
        command = [*fabric_command(), "--accelerator", "cpu", "--devices", "2", "--main-port", free_port()]
        command += ["--hang-timeout", LIMIT, HANG, "cli", stuck, tmp_path]
        env = job_env(OMP_NUM_THREADS="1")
    else:
        command = [sys.executable, HANG, launcher, stuck, tmp_path]
        env = job_env(OMP_NUM_THREADS="1", FABRIC_HANG_TIMEOUT=str(LIMIT))
    job, code = run_job([str(c) for c in command], tmp_path / "log.txt", START_TIMEOUT + WITHIN, env=env)
    return code, job.output()


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("launcher", "stuck"), [("script", 1), ("script", 0), ("spawn", 1), ("cli", 1)], ids=["launch-child", "launch-rank0", "spawn", "fabric-run"]
)
def test_a_stuck_rank_ends_the_job_named_with_its_line_and_stack(tmp_path: Path, launcher: str, stuck: int):
    code, output = _run(tmp_path, launcher, stuck)
    ended = time.time()
    assert (tmp_path / "stuck_at").exists(), output[-4000:]
    took = ended - float((tmp_path / "stuck_at").read_text())
    assert took < WITHIN, f"the job needed {took:.1f} s to end after rank {stuck} got stuck:\n{output[-3000:]}"
    assert code == (1 if launcher == "spawn" else hang.HANG_EXIT_CODE), output[-4000:]  # spawn: the caller raises
    where = f"{HANG}:{STUCK_LINE} in body(): time.sleep(600)  # STUCK HERE"
    assert f"[fabric] Rank {stuck} made no progress for" in output and where in output, output[-4000:]
    assert f'File "{HANG}", line {STUCK_LINE} in body' in output  # faulthandler's dump of the stuck rank
    last_lines = "\n".join(output.strip().splitlines()[-15:])
    assert f"HangError: Rank {stuck} made no progress" in last_lines, last_lines


@pytest.mark.multiprocess
def test_a_job_that_makes_progress_is_not_stopped(tmp_path: Path):
    code, output = _run(tmp_path, "script", -1)
    assert code == 0, output[-4000:]
    assert (tmp_path / "done0").exists() and (tmp_path / "done1").exists()
    assert "made no progress" not in output


@pytest.mark.parametrize(("value", "expected"), [("", None), ("0", None), ("2.5", 2.5), (" 30 ", 30.0)])
def test_the_limit_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch, value: str, expected):
    monkeypatch.setenv(hang.HANG_TIMEOUT_VARIABLE, value)
    assert hang.hang_timeout() == expected


@pytest.mark.parametrize(("value", "words"), [("soon", "must be a number of seconds"), ("-1", "must not be negative")])
def test_a_bad_limit_is_refused_by_name(monkeypatch: pytest.MonkeyPatch, value: str, words: str):
    monkeypatch.setenv(hang.HANG_TIMEOUT_VARIABLE, value)
    with pytest.raises(ValueError, match=f"FABRIC_HANG_TIMEOUT={value}.*{words}"):
        hang.hang_timeout()
