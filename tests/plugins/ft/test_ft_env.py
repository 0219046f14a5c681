"""``fabric env`` names the lighthouse of ``$TORCHFT_LIGHTHOUSE`` and its quorum, asked of a real lighthouse (torchft's
``LighthouseServer`` on loopback); one that does not answer, or none configured, is said so. The quorum of a live
job is checked in test_ft_kill_rejoin.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from jobs import job_env

pytest.importorskip("fabric_ft")
pytest.importorskip("torchft")

from fabric_core.environments import find_free_port  # noqa: E402
from fabric_ft.probe import lighthouse_state  # noqa: E402


@pytest.fixture
def lighthouse():
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    port = server.address().rsplit(":", 1)[1]  # it names the machine's hostname; it listens on loopback
    yield f"http://127.0.0.1:{port}"
    server.shutdown()


def test_a_live_lighthouse_without_groups(lighthouse: str):
    state = lighthouse_state(lighthouse)
    assert state.startswith(f"reachable at {lighthouse}: quorum 0"), state
    assert "no quorum formed yet" in state and "0 heartbeating" in state, state


def test_a_lighthouse_that_does_not_answer_is_named():
    address = f"http://127.0.0.1:{find_free_port()}"  # nothing listens there
    state = lighthouse_state(address)
    assert state.startswith(f"NOT reachable at {address}"), state


def test_none_configured(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    assert lighthouse_state().startswith("none configured (TORCHFT_LIGHTHOUSE is not set")


def test_fabric_env_shows_the_lighthouse(lighthouse: str):
    fabric = Path(sys.executable).parent / "fabric"
    command = [str(fabric), "env"] if fabric.exists() else [sys.executable, "-m", "fabric_core.cli", "env"]
    out = subprocess.run(command, env=job_env(TORCHFT_LIGHTHOUSE=lighthouse), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    line = next((ln for ln in out.stdout.splitlines() if "torchft lighthouse" in ln), None)
    assert line is not None and f"reachable at {lighthouse}: quorum 0" in line, out.stdout
