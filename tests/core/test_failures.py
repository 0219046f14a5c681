"""A failed rank's own error, recorded by the process and reported by the launcher (fabric_core.runtime.failures.py).

The jobs that exercise this end to end (rank 1 dying in the rendezvous under every launcher) are in
tests/plugins/ddp/test_ddp_failures.py; here the recording in a real interpreter and the ordering rules.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from fabric_core.runtime import failures
from fabric_core.runtime.failures import RankFailure, RecordedError

RAISE = (
    "from fabric_core.runtime import failures\n"
    "failures.record_uncaught_errors()\n"
    "def deep():\n"
    "    raise ValueError('boom in rank 1')\n"
    "deep()\n"
)


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in (failures.ERROR_FILE_VARIABLE, failures.TORCHELASTIC_ERROR_FILE)}
    clean.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=clean, timeout=60)


def test_an_uncaught_exception_is_recorded_and_still_printed(tmp_path: Path):
    # multiprocess-check: single process (one process records its own error)
    path = tmp_path / "rank1.json"
    done = _python(RAISE, **{failures.ERROR_FILE_VARIABLE: str(path)})
    assert done.returncode == 1
    assert "ValueError: boom in rank 1" in done.stderr  # printed as usual
    recorded = failures.read_error_file(str(path))
    assert recorded is not None and recorded.message == "ValueError: boom in rank 1"
    assert "in deep" in recorded.traceback and recorded.traceback.rstrip().endswith("ValueError: boom in rank 1")
    # torchrun reads the same file: its summary shows our message and the traceback
    seen_by_torch = ProcessFailure(local_rank=1, pid=123, exitcode=1, error_file=str(path))
    assert seen_by_torch.message["message"] == "ValueError: boom in rank 1"
    assert seen_by_torch.timestamp == recorded.time_ns // 1_000_000_000


def test_torchruns_variable_is_used_when_ours_is_not_set(tmp_path: Path):
    # multiprocess-check: single process (one process records its own error)
    path = tmp_path / "error.json"
    assert _python(RAISE, **{failures.TORCHELASTIC_ERROR_FILE: str(path)}).returncode == 1
    assert failures.read_error_file(str(path)).message == "ValueError: boom in rank 1"


def test_nothing_is_installed_without_an_error_file():
    done = _python(
        "import sys; hook = sys.excepthook; from fabric_core.runtime import failures;"
        " failures.record_uncaught_errors(); print(sys.excepthook is hook)"
    )
    assert done.stdout.strip() == "True", done.stderr


def _error(message: str, at: int, lines: int = 3) -> RecordedError:
    trace = "Traceback (most recent call last):\n" + "".join(f'  File "x.py", line {i}\n' for i in range(lines))
    return RecordedError(message, trace + message + "\n", at)


def test_the_root_cause_is_the_first_error_or_a_silent_death():
    consequence = RankFailure("Local rank 0", 10, 1, _error("RuntimeError: Connection closed by peer", at=200))
    cause = RankFailure("Local rank 1", 11, 1, _error("RuntimeError: rank 1's own error", at=100))
    stopped = RankFailure("Local rank 2", 12, 143)  # SIGTERM, no error: how launchers stop the others
    assert failures.first_failures([consequence, stopped, cause]) == [cause, consequence, stopped]
    killed = RankFailure("Local rank 3", 13, 137)  # SIGKILL (out of memory?) makes the others fail
    assert failures.first_failures([consequence, cause, killed])[0] is killed


def test_the_report_quotes_the_first_failures_traceback_end_and_lists_the_others():
    cause = RankFailure("Local rank 1", 11, 1, _error("RuntimeError: rank 1's own error", at=100, lines=80))
    consequence = RankFailure("Local rank 0", 10, 1, _error("RuntimeError: Connection closed by peer", at=200))
    text = failures.report_failures([consequence, cause])
    lines = text.splitlines()
    assert lines[0] == "[fabric] First failure: Local rank 1 (pid 11) exited with code 1: RuntimeError: rank 1's own error"
    assert "    RuntimeError: rank 1's own error" in lines
    assert "    ..." in lines and 'line 0\n' not in text  # only the end of a long traceback
    assert len([line for line in lines if line.startswith("    ")]) == failures.TRACEBACK_LINES + 1
    assert lines[-1] == (
        "[fabric] Failed after it (likely a consequence): Local rank 0 (pid 10) exited with code 1:"
        " RuntimeError: Connection closed by peer"
    )
    killed = failures.report_failures([RankFailure("Local rank 1", 11, 137)])
    assert "exited with code 137 (killed by SIGKILL), without a Python error" in killed
    assert "ended without raising a Python exception" in killed
    # exit code 1 and nothing recorded: an uncaught exception before `Fabric()` existed, its traceback printed above
    early = failures.report_failures([RankFailure("Local rank 0", 10, 1)])
    assert "without a Python error" not in early and "without raising" not in early
    assert "exited with code 1, with no error recorded (a Python error before `Fabric()` was created?" in early
    assert "its traceback is in its output above" in early


def test_the_job_exits_with_the_first_failures_code():
    raised = _error("RuntimeError: rank 1's own error", at=100)
    assert failures.job_exit_code([RankFailure("Local rank 1", 11, 7)]) == 7  # os._exit(7)
    assert failures.job_exit_code([RankFailure("Local rank 1", 11, 137), RankFailure("Local rank 0", 10, 1, raised)]) == 137
    # it raised, and its launcher stopped it while it was exiting: the exit of an uncaught exception
    assert failures.job_exit_code([RankFailure("Rank 1", None, 143, raised), RankFailure("Rank 0", None, 1, _error("x", 200))]) == 1
    assert failures.job_exit_code([]) == 1


@pytest.mark.multiprocess
def test_a_barrier_whose_peer_left_names_the_rank_and_where_this_one_waited(tmp_path):
    """Not gloo's "Connection closed by peer" ten frames deep: who left, and the user's line that waited."""
    pytest.importorskip("fabric_ddp", reason="needs fabric-ddp (the XLA lane installs only fabric-core and fabric-xla)")
    import json

    from jobs import run_ranks

    script = Path(__file__).parent / "scripts" / "peer_left_job.py"
    run_ranks(script, str(tmp_path), world_size=2, timeout=120, tmp_path=tmp_path)
    error = json.loads((tmp_path / "rank0.json").read_text())["error"]
    assert error is not None and error.startswith("RuntimeError: rank 1 left the job while rank 0 waited in barrier() at")
    assert "peer_left_job.py:18" in error  # the line of the script's second barrier
