"""Ray Tune on the real two-node cluster: the documented sweep example (examples/ray_tune/tune_sweep.py), small,
runs Fabric training loops as Tune trials that share the cluster's CPUs, and each trial's metrics and checkpoint
reach Tune through ``Fabric(loggers="ray")``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.jobs import start_job
from tests.plugins.ray.conftest import HEAD_IP

EXAMPLE = Path(__file__).parents[3] / "examples" / "ray_tune" / "tune_sweep.py"
TIMEOUT = 420


@pytest.mark.multiprocess
@pytest.mark.timeout(TIMEOUT + 60)
def test_the_sweep_example_reports_every_trials_metrics_and_checkpoint(ray_cluster, tmp_path: Path) -> None:
    command = [sys.executable, EXAMPLE, "--trials", "2", "--steps", "5", "--node-ip", HEAD_IP, "--storage-path", tmp_path / "results"]
    job = start_job(command, tmp_path / "tune.log", ray_cluster.env())
    code = job.wait(TIMEOUT)
    output = job.output()
    assert code == 0, output[-6000:]
    trials = [line for line in output.splitlines() if line.startswith("lr=")]
    assert len(trials) == 2 and all("checkpoint=True" in line and "error" not in line for line in trials), output[-4000:]
    best = json.loads(output.split("BEST ", 1)[1].splitlines()[0])
    assert best["trials"] == 2 and best["errors"] == 0 and best["lr"] in (0.3, 0.1)
    losses = {float(line.split()[0][3:]): float(line.split()[1][5:]) for line in trials}
    assert best["loss"] == pytest.approx(min(losses.values()), rel=1e-3), (best, losses)
    # Tune kept a checkpoint per trial in its storage, with fabric-ray's note of where fabric.save wrote it
    notes = list((tmp_path / "results" / "fabric_lr_sweep").glob("*/checkpoint_*/fabric_checkpoint.json"))
    assert len(notes) == 2, sorted(str(p) for p in (tmp_path / "results").rglob("*"))[:40]
    assert all(json.loads(n.read_text())["name"] == "final.ckpt" for n in notes)
