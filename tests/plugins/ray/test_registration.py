"""fabric-ray outside Ray: what it registers, what ``fabric env`` reports, and that nothing of Ray is imported by
``import fabric_core``, ``Fabric()`` or listing plugins. No cluster is started here."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from importlib.metadata import version

import pytest

from tests.jobs import job_env


def _python(code: str, **env: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=240, env=job_env(**env)
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_fabric_and_its_plugin_listing_import_nothing_of_ray() -> None:
    out = _python(
        """
        import json, sys
        import fabric_core
        from fabric_core import Fabric
        fabric = Fabric(accelerator="cpu")
        from fabric_core.plugins import get_registry
        registry = get_registry()
        names = sorted(e.name for e in registry.entries("environment"))
        loggers = sorted(e.name for e in registry.entries("logger"))
        launchers = sorted(e.name for e in registry.entries("launcher"))
        print(json.dumps([names, loggers, launchers, sorted(m for m in sys.modules if m == "ray" or m.startswith(("ray.", "fabric_ray.environment", "fabric_ray.logger", "fabric_ray.launcher")))]))
        """
    )
    environments, loggers, launchers, imported = json.loads(out.strip().splitlines()[-1])
    assert "ray" in environments and "ray" in loggers and "ray" in launchers
    assert imported == [], imported


def test_fabric_env_reports_rays_version() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "fabric_core.cli", "env"], capture_output=True, text=True, timeout=240, env=job_env()
    )
    assert done.returncode == 0, done.stderr
    line = next(line for line in done.stdout.splitlines() if line.strip().startswith("ray:"))
    assert line.split(":", 1)[1].strip() == version("ray")


def test_fabric_env_says_whether_the_ray_cluster_answers_within_seconds(tmp_path) -> None:
    """A real TCP endpoint stands in for the head node here (the cluster tests check a real one)."""
    import socket

    def cluster_line(**env: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "fabric_core.cli", "env"], capture_output=True, text=True, timeout=60,
            env=job_env(RAY_TMPDIR=str(tmp_path), **env),
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return next(line for line in done.stdout.splitlines() if line.strip().startswith("Ray cluster:"))

    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        address = f"127.0.0.1:{listening.getsockname()[1]}"
        assert f"reachable at {address} (RAY_ADDRESS)" in cluster_line(RAY_ADDRESS=address)
    assert f"NOT reachable at {address} from RAY_ADDRESS" in cluster_line(RAY_ADDRESS=address)
    assert "none configured" in cluster_line()
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text(address)  # what `ray start` leaves for this machine
    assert f"NOT reachable at {address} from started on this machine" in cluster_line()


def test_a_ray_worker_that_is_not_a_train_worker_is_not_taken_for_one() -> None:
    """``RAY_RAYLET_PID`` (every Ray worker process has it) only makes the registry ask; without Ray Train's context
    the environment says no, and Fabric falls back as anywhere else."""
    out = _python(
        """
        from fabric_core.plugins import get_registry
        from fabric_ray.environment import RayTrainEnvironment
        detected = get_registry().decisions.detect_cluster_environment()
        print("DETECT", RayTrainEnvironment.detect(), type(detected).__name__)
        """,
        RAY_RAYLET_PID="1",
    )
    assert "DETECT False PlainEnvironment" in out, out


def test_the_ray_logger_outside_ray_train_says_where_it_belongs() -> None:
    from fabric_core import Fabric

    with pytest.raises(RuntimeError, match="neither a Ray Train worker nor a Tune trial.*train_loop_per_worker"):
        Fabric(accelerator="cpu", loggers="ray")
