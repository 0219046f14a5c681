"""The process helpers every launcher uses (``fabric_core.launchers``): stopping a process with what it started,
the death signal, the exit status; and the environment a script launcher starts a process of ``fabric run`` with.

Real processes throughout: a child that starts a grandchild and ignores SIGTERM, a parent killed with SIGKILL.
"""

from __future__ import annotations

import multiprocessing
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from fabric_core.launchers import (
    ScriptRequest,
    exit_status,
    new_process_group,
    parent_death_signal,
    signal_process_group,
    stop_processes,
)
from fabric_core.strategies import Topology

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups and prctl are Linux's")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_for(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


# A child that ignores SIGTERM and starts a grandchild (in its group) that does too; each prints its pid.
_STUBBORN = textwrap.dedent(
    """
    import signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
    print(child.pid, flush=True)
    time.sleep(600)
    """
)


@linux_only
def test_stop_processes_ends_a_process_that_ignores_sigterm_and_what_it_started_within_the_grace_period():
    child = subprocess.Popen([sys.executable, "-c", _STUBBORN], stdout=subprocess.PIPE, text=True, **new_process_group())
    grandchild = int(child.stdout.readline())
    assert _alive(child.pid) and _alive(grandchild)
    start = time.monotonic()
    stop_processes([child], grace=0.5)
    took = time.monotonic() - start
    assert child.returncode == -signal.SIGKILL and exit_status(child.returncode) == 137
    assert _wait_for(lambda: not _alive(grandchild)), "the grandchild outlived its process group's SIGKILL"
    assert took < 10, f"stopping took {took:.1f} s"


@linux_only
def test_stop_processes_sweeps_the_group_of_a_child_that_already_exited():
    """A child that ended on its own may leave a grandchild in its group (a DataLoader worker): it goes too."""
    script = "import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); print(p.pid, flush=True)"
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, **new_process_group())
    grandchild = int(child.stdout.readline())
    assert child.wait(timeout=30) == 0 and _alive(grandchild)
    stop_processes([child], grace=0.5)
    assert _wait_for(lambda: not _alive(grandchild))


def _sleep() -> None:
    time.sleep(600)


@linux_only
def test_stop_processes_stops_multiprocessing_workers_that_lead_no_group():
    worker = multiprocessing.get_context("spawn").Process(target=_sleep)
    worker.start()
    try:
        signal_process_group(worker, 0)  # leads no group: the worker itself is signalled, and still runs
        assert worker.is_alive()
        stop_processes([worker], grace=5.0)
        assert worker.exitcode == -signal.SIGTERM and exit_status(worker.exitcode) == 143
    finally:
        if worker.is_alive():
            worker.kill()


@linux_only
def test_parent_death_signal_kills_the_child_when_its_parent_is_killed():
    # the parent starts a child with the death signal, prints its pid and waits; we SIGKILL the parent
    parent_script = textwrap.dedent(
        """
        import subprocess, sys, time
        from fabric_core.launchers import parent_death_signal
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], preexec_fn=parent_death_signal())
        print(child.pid, flush=True)
        time.sleep(600)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", parent_script], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    assert _alive(child)
    parent.kill()
    parent.wait(timeout=30)
    assert _wait_for(lambda: not _alive(child)), "the child outlived its killed parent"


def test_parent_death_signal_is_a_preexec_function_on_linux():
    hook = parent_death_signal()
    assert (hook is not None) == sys.platform.startswith("linux")


def test_exit_status_is_the_shells():
    assert exit_status(0) == 0 and exit_status(3) == 3
    assert exit_status(-signal.SIGKILL) == 137 and exit_status(-signal.SIGSEGV) == 139


# ---------------------------------------------------------------------------------------------- script launchers
def test_process_environment_has_the_cli_gate_the_settings_and_torchruns_variables():
    request = ScriptRequest(
        script="train.py", script_args=[], module=False, processes_per_node=2, num_nodes=2, max_restarts=3,
        environment={"FABRIC_STRATEGY": "ddp", "FABRIC_DEVICES": "2"},
    )  # fmt: skip
    env = request.process_environment(1, 1, "10.0.0.1", 29500, restart=2)
    assert env["FABRIC_CLI_USED"] == "1"  # set even though the request's environment lacks it: the settings' gate
    assert env["FABRIC_STRATEGY"] == "ddp" and env["FABRIC_DEVICES"] == "2"
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK")} == {
        "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "NODE_RANK": "1", "GROUP_RANK": "1",
    }  # fmt: skip
    assert env["MASTER_ADDR"] == "10.0.0.1" and env["MASTER_PORT"] == "29500"
    assert env["TORCHELASTIC_RESTART_COUNT"] == "2" and env["TORCHELASTIC_MAX_RESTARTS"] == "3"
    # one rendezvous id for every process and every restart of the job
    assert env["TORCHELASTIC_RUN_ID"] == request.process_environment(0, 0, "10.0.0.1", 29500)["TORCHELASTIC_RUN_ID"]
    # it is Topology's placement, nothing written twice
    assert Topology(2, 2, 1, 1).environment("10.0.0.1", 29500, torchrun=True).items() <= env.items()


def test_process_environment_refuses_a_process_outside_the_job():
    request = ScriptRequest(script="t.py", script_args=[], module=False, processes_per_node=2, num_nodes=1, max_restarts=0)
    with pytest.raises(ValueError, match=r"\(node_rank=0, local_rank=2\) is not part of this job of 1 node\(s\) x 2"):
        request.process_environment(0, 2, "127.0.0.1", 1234)


def test_fabric_settings_without_the_cli_gate_are_ignored_with_a_warning(monkeypatch):
    from fabric_core import Fabric

    monkeypatch.delenv("FABRIC_CLI_USED", raising=False)
    monkeypatch.setenv("FABRIC_STRATEGY", "ddp")
    monkeypatch.setenv("FABRIC_DEVICES", "2")
    with pytest.warns(UserWarning, match=r"FABRIC_STRATEGY=ddp, FABRIC_DEVICES=2 are set, but .* ignored here"):
        fabric = Fabric(accelerator="cpu")
    assert fabric.world_size == 1 and type(fabric.strategy).__name__ == "SingleDeviceStrategy"
