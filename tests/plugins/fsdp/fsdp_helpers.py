"""Helpers for the FSDP tests: start real rank processes (gloo) with a hard timeout.

Every rank is started by :func:`run_ranks` with the variables a launcher exports (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` on a free port), so Fabric sees processes created externally.
If one rank fails, the others are killed at once; if the job outlives ``timeout``, all of them are, and the
test fails with every rank's output.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).parent / "scripts"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FABRIC_", "TORCHELASTIC_", "SLURM_", "OMPI_", "PMI_"))}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        env.pop(key, None)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONWARNINGS"] = "ignore"
    env.update(extra or {})
    return env


def _kill(processes: list[subprocess.Popen]) -> None:
    for p in processes:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in processes:
        p.wait()


def _finish(processes: list[subprocess.Popen], logs: list[Path], timeout: float, what: str) -> list[str]:
    deadline = time.monotonic() + timeout
    failed = None
    while True:
        codes = [p.poll() for p in processes]
        failed = next((i for i, c in enumerate(codes) if c not in (None, 0)), None)
        if failed is not None or all(c == 0 for c in codes) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    timed_out = failed is None and not all(p.poll() == 0 for p in processes)
    _kill(processes)
    outputs = [log.read_text(errors="replace") for log in logs]
    if failed is not None or timed_out:
        reason = f"rank {failed} exited with {processes[failed].returncode}" if failed is not None else f"timeout {timeout}s"
        dump = "\n".join(f"----- rank {i} -----\n{out[-6000:]}" for i, out in enumerate(outputs))
        pytest.fail(f"{what} failed ({reason}):\n{dump}")
    return outputs


def run_ranks(script: str, *args: str, world_size: int = 2, timeout: float = 120, tmp_path: Path) -> list[str]:
    """Run ``scripts/<script>`` as ``world_size`` ranks; returns each rank's output."""
    port = str(free_port())
    processes, logs = [], []
    for rank in range(world_size):
        env = _clean_env(
            {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        )
        log = tmp_path / f"{script}.{world_size}.rank{rank}.log"
        with open(log, "w") as out:
            processes.append(
                subprocess.Popen([sys.executable, str(SCRIPTS / script), *args], env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            )
        logs.append(log)
    return _finish(processes, logs, timeout, f"{script} on {world_size} ranks")


def run_script(script: str, *args: str, timeout: float = 120, tmp_path: Path) -> str:
    """Run ``scripts/<script>`` as one plain process (it may launch more itself)."""
    log = tmp_path / f"{script}.single.log"
    with open(log, "w") as out:
        process = subprocess.Popen(
            [sys.executable, str(SCRIPTS / script), *args], env=_clean_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    return _finish([process], [log], timeout, script)[0]


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())
