"""Fabric inside Ray Train on a real two-node Ray cluster (loopback, gloo on CPU): ranks from Ray's context, Ray's
process group used as it is, ``launch()`` starting nothing, a clear error for a Fabric that contradicts Ray's
ScalingConfig, and (``loggers="ray"``) metrics and checkpoints in Ray, with an exact resume after a worker is
SIGKILLed. One cluster for the module (``ray_cluster``); every driver is a job with a timeout."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from tests.jobs import start_job, wait_until

SCRIPT = Path(__file__).with_name("ray_job.py")
FIT_TIMEOUT = 420  # one fit: 1-3 minutes on the 2 cores this machine shares (Ray's start of the worker group included)


def _run(cluster, tmp_path: Path, *args: str, timeout: float, expect: int = 0) -> str:
    job = start_job([os.environ.get("PYTHON", __import__("sys").executable), SCRIPT, *args], tmp_path / f"{args[0]}.log", cluster.env())
    code = job.wait(timeout)
    output = job.output()
    assert code == expect, f"driver exited {code}:\n{output[-6000:]}"
    return output


#: Each fit costs a minute or more here (Ray starts a controller, a placement group and two workers): two fits cover a
#: strategy per layout (ddp over two nodes, fsdp on one), and every rank of both must end with one process's weights.
RUNS = {"ddp": "spread", "fsdp": "pack"}
#: float32 rounding of the ranks' averaged gradients against one process's mean over both batches; computed in plain
#: torch, a rank that trained on its own batch only (no gradient averaging) ends 0.35 away, summed gradients 0.31, a
#: missed step 0.25
TOLERANCE = 1e-5


def _same_as_one_process(out: Path, name: str, rank: int) -> None:
    from tests.plugins.ray.ray_job import reference_weights

    expected = reference_weights()
    weights = torch.load(out / f"{name}-rank{rank}.pt", weights_only=True)
    assert weights.keys() == expected.keys(), (name, rank, sorted(weights))
    for key, tensor in expected.items():
        difference = (weights[key] - tensor).abs().max().item()
        assert difference <= TOLERANCE, f"{name} rank {rank} {key} is {difference:.3g} from one process's weights"


@pytest.mark.multiprocess
@pytest.mark.timeout(FIT_TIMEOUT * 2 + 60)
def test_fabric_inside_ray_train_takes_ranks_and_process_group_from_ray(ray_cluster, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    _run(ray_cluster, tmp_path, "ranks", str(out), *(f"{s}:{p}" for s, p in RUNS.items()), timeout=FIT_TIMEOUT * 2)
    for strategy, placement in RUNS.items():
        records = [json.loads((out / f"{strategy}-{placement}-rank{r}.json").read_text()) for r in (0, 1)]
        for rank, record in enumerate(records):
            assert record["environment"] == "RayTrainEnvironment", record
            # Fabric's ranks are Ray's: (global, local, node, world)
            assert record["fabric"] == record["ray"], record
            assert record["fabric"][0] == rank and record["fabric"][3] == 2
            assert record["ray_made_group"] and record["same_group"], "Fabric used Ray's process group as it is"
            assert record["backend"] == "gloo"
            assert record["launcher"] is None and record["children"] == 0, "launch() started nothing"
            assert record["group_alive_after_teardown"], "Fabric's teardown leaves Ray's group to Ray"
        if placement == "spread":  # one worker per node: node ranks 0 and 1, both local rank 0
            assert [r["fabric"][1:3] for r in records] == [[0, 0], [0, 1]], records
        else:  # both on one node
            assert [r["fabric"][1:3] for r in records] == [[0, 0], [1, 0]], records
        # every rank's own copy of the whole model (FSDP's shards gathered, nothing reduced) equals one process that
        # trained on both ranks' batches in plain torch, weight by weight
        for rank in (0, 1):
            _same_as_one_process(out, f"{strategy}-{placement}", rank)


@pytest.mark.multiprocess
@pytest.mark.timeout(FIT_TIMEOUT * 2 + 60)
def test_deepspeed_and_model_parallel_inside_ray_train_train_like_one_process(ray_cluster, tmp_path: Path) -> None:
    """The other two multi-process strategies, one worker per node: Ray's ranks and group, launch() starting nothing,
    and the weights of one process that trains on both ranks' batches."""
    runs = ("deepspeed", "model_parallel")
    out = tmp_path / "out"
    out.mkdir()
    _run(ray_cluster, tmp_path, "ranks", str(out), *(f"{s}:spread" for s in runs), timeout=FIT_TIMEOUT * 2)
    for strategy in runs:
        records = [json.loads((out / f"{strategy}-spread-rank{r}.json").read_text()) for r in (0, 1)]
        for rank, record in enumerate(records):
            assert record["environment"] == "RayTrainEnvironment", record
            assert record["fabric"] == record["ray"] and record["fabric"] == [rank, 0, rank, 2], record
            assert record["ray_made_group"] and record["same_group"], (strategy, record)
            assert record["launcher"] is None and record["children"] == 0, (strategy, record)
        for rank in (0, 1):
            _same_as_one_process(out, f"{strategy}-spread", rank)


@pytest.mark.multiprocess
@pytest.mark.timeout(FIT_TIMEOUT + 60)
def test_fabric_contradicting_ray_scaling_config_is_a_clear_error(ray_cluster, tmp_path: Path) -> None:
    output = _run(ray_cluster, tmp_path, "mismatch", str(tmp_path), timeout=FIT_TIMEOUT, expect=3)
    assert "`Fabric(devices=4, num_nodes=1)`" in output, output[-4000:]
    assert "`num_workers=2`" in output and "Inside Ray Train the ScalingConfig decides: pass" in output, output[-4000:]
    # more workers than the cluster has CPUs (2 nodes x 2): with the README's recipe for a cluster of fixed size
    # (no controller retries, a short start timeout) fit() ends with Ray's reason instead of retrying without end
    started = time.monotonic()
    output = _run(ray_cluster, tmp_path, "too_many", str(tmp_path), timeout=FIT_TIMEOUT, expect=3)
    assert "FAILED" in output and "timed out after 5.0 seconds waiting for 6 workers" in output, output[-4000:]
    assert time.monotonic() - started < 150, "ended, not retried"


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


@pytest.mark.multiprocess
@pytest.mark.timeout(FIT_TIMEOUT * 3 + 60)
def test_worker_sigkilled_mid_run_resumes_from_rays_checkpoint_exactly(ray_cluster, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    output = _run(ray_cluster, tmp_path, "resume", str(out), "straight", timeout=FIT_TIMEOUT)
    straight = json.loads(output.split("RESULT ", 1)[1].splitlines()[0])
    assert straight["metrics"]["step"] == 20 and "loss" in straight["metrics"], straight
    assert straight["checkpoint"].endswith("straight/step-0020.ckpt"), straight
    assert (Path(straight["checkpoint"]) / "step-0020.ckpt").is_file(), "the checkpoint is in Ray's storage"
    assert "RESUMED" not in output

    (out / "progress").unlink()
    job = start_job([__import__("sys").executable, SCRIPT, "resume", str(out), "killed"], tmp_path / "killed.log", ray_cluster.env())

    def progressed() -> bool:
        try:
            pid, step = (out / "progress").read_text().split()
        except (OSError, ValueError):
            return False
        return int(step) >= 7

    assert wait_until(progressed, FIT_TIMEOUT, 0.05), job.output()[-4000:]
    pid, step = (out / "progress").read_text().split()
    os.kill(int(pid), signal.SIGKILL)  # rank 1's Ray worker, mid-run
    code = job.wait(FIT_TIMEOUT * 2)  # the failed attempt, then the restarted one
    output = job.output()
    assert code == 0, output[-6000:]
    killed = json.loads(output.split("RESULT ", 1)[1].splitlines()[0])
    assert killed["metrics"]["step"] == 20, killed
    resumed = [line for line in output.splitlines() if "RESUMED" in line]
    assert resumed, output[-6000:]
    # resumed from a checkpoint Ray had (the local folder was emptied), at or after the step the kill came after
    assert "restored=" in resumed[0] and "restored=None" not in resumed[0], resumed
    assert int(resumed[0].split(" step ")[1].split()[0]) >= 5, resumed
    a, b = _weights(out / "straight.pt"), _weights(out / "killed.pt")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
