"""fabric-mlflow against a real MLflow tracking server on loopback (SQLite store, artifacts served over HTTP),
read back with ``MlflowClient``: in this process, and as real jobs of 1 and 2 CPU processes."""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path

import pytest
import torch
from jobs import job_env, run_job
from mlflow.tracking import MlflowClient

from fabric_core import Fabric
from fabric_mlflow import MLFlowLogger

JOB = Path(__file__).parents[1] / "tracker_job.py"
LOGGER = {"class": "fabric_mlflow:MLFlowLogger"}


def _experiment() -> str:
    return f"exp-{uuid.uuid4().hex[:8]}"


def _runs(uri: str, experiment: str) -> list:
    client = MlflowClient(uri)
    found = client.get_experiment_by_name(experiment)
    return [] if found is None else client.search_runs([found.experiment_id])


def _run_job(tmp_path: Path, config: dict, timeout: float = 240):
    return run_job([sys.executable, JOB, json.dumps(config)], tmp_path / "job.log", timeout, env=job_env(OMP_NUM_THREADS="1"))


def test_params_metrics_tags_checkpoint_and_status_read_back(tracking_uri, tmp_path):
    experiment = _experiment()
    logger = MLFlowLogger(experiment_name=experiment, run_name="first", tags={"team": "vision"}, log_checkpoints=True)
    assert logger.version is None  # nothing created yet
    fabric = Fabric(accelerator="cpu", loggers=logger)
    assert _runs(tracking_uri, experiment) == []

    fabric.logger.log_hyperparams({"lr": 0.1, "optimizer": {"name": "adamw", "betas": (0.9, 0.99)}, "fn": len})
    with pytest.warns(UserWarning, match="MLflow does not accept the name 'bad name!'; it is logged as 'bad name_'"):
        for step in range(4):
            fabric.log_dict({"train/loss": torch.tensor(1.0 / (step + 1)), "bad name!": 1.0}, step=step * 10)
    model = torch.nn.Linear(3, 2)
    fabric.save(tmp_path / "ckpt" / "step-30.ckpt", {"model": model})
    fabric.teardown()

    client = MlflowClient(tracking_uri)
    (run,) = _runs(tracking_uri, experiment)
    assert run.info.run_id == logger.version and run.info.run_name == "first"
    assert run.info.status == "FINISHED"
    assert run.data.tags["team"] == "vision"
    assert run.data.params == {
        "lr": "0.1", "optimizer/name": "adamw", "optimizer/betas": "(0.9, 0.99)", "fn": str(len)
    }  # fmt: skip
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [(m.step, round(m.value, 6)) for m in history] == [(0, 1.0), (10, 0.5), (20, 0.333333), (30, 0.25)]
    assert "bad name_" in run.data.metrics  # an invalid character is replaced (with a warning), not fatal

    # The checkpoint was uploaded over HTTP after its save was durable; the copy equals the file on disk.
    (artifact,) = client.list_artifacts(run.info.run_id, "checkpoints")
    assert artifact.path == "checkpoints/step-30.ckpt"
    local = client.download_artifacts(run.info.run_id, artifact.path, str(tmp_path / "download"))
    assert Path(local).read_bytes() == (tmp_path / "ckpt" / "step-30.ckpt").read_bytes()


def test_finalize_is_idempotent_and_maps_statuses(tracking_uri):
    experiment = _experiment()
    logger = MLFlowLogger(experiment_name=experiment)
    logger.finalize("success")  # never started: nothing is created for it
    assert _runs(tracking_uri, experiment) == []
    logger.log_metrics({"x": 1.0})
    logger.finalize("killed")
    logger.finalize("success")  # a second finalize changes nothing
    (run,) = _runs(tracking_uri, experiment)
    assert run.info.status == "KILLED"
    with pytest.raises(ValueError, match="Unknown run status 'done'"):
        logger.finalize("done")


def test_resume_an_existing_run_by_id(tracking_uri):
    experiment = _experiment()
    first = MLFlowLogger(experiment_name=experiment)
    first.log_metrics({"loss": 2.0}, step=0)
    first.finalize("failed")
    run_id = first.version

    resumed = MLFlowLogger(run_id=run_id, tags={"resumed": "yes"})
    resumed.log_metrics({"loss": 1.0}, step=1)
    resumed.finalize("success")
    (run,) = _runs(tracking_uri, experiment)
    assert run.info.run_id == run_id and run.info.status == "FINISHED" and run.data.tags["resumed"] == "yes"
    history = MlflowClient(tracking_uri).get_metric_history(run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(0, 2.0), (1, 1.0)]


def test_asynchronous_batches_arrive_by_finalize(tracking_uri):
    experiment = _experiment()
    logger = MLFlowLogger(experiment_name=experiment, synchronous=False)
    for step in range(50):
        logger.log_metrics({"loss": float(step)}, step=step)
    logger.finalize("success")
    (run,) = _runs(tracking_uri, experiment)
    assert len(MlflowClient(tracking_uri).get_metric_history(run.info.run_id, "loss")) == 50


def test_unsupported_values_are_skipped_with_a_warning(tracking_uri):
    logger = MLFlowLogger(experiment_name=_experiment())
    with pytest.warns(UserWarning, match="MLflow logs numbers only: the metric 'note'"):
        logger.log_metrics({"note": "hello", "loss": 1.0})
    logger.finalize("success")
    assert MlflowClient(tracking_uri).get_run(logger.version).data.metrics == {"loss": 1.0}


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "launch",
    [
        pytest.param({"strategy": "ddp"}, id="script"),
        # spawned processes never run atexit: the run is closed by the multiprocessing exit hook
        pytest.param({"strategy": "ddp_spawn", "mode": "function"}, id="spawn-function"),
    ],
)
def test_two_processes_only_rank_zero_logs(tracking_uri, tmp_path, launch):
    experiment = _experiment()
    config = {
        "loggers": {"mlflow": {"experiment_name": experiment, "log_checkpoints": True}},  # by name, with options
        "devices": 2, "steps": 3, "checkpoint": str(tmp_path / "final.ckpt"), "out": str(tmp_path), **launch,
    }  # fmt: skip
    job, code = _run_job(tmp_path, config)
    assert code == 0, job.output()[-4000:]
    (run,) = _runs(tracking_uri, experiment)  # one run, not one per rank
    assert run.info.status == "FINISHED"  # nobody called finalize: closed at exit
    client = MlflowClient(tracking_uri)
    assert [m.value for m in client.get_metric_history(run.info.run_id, "rank")] == [0.0, 0.0, 0.0]
    assert run.data.params["world_size"] == "2"
    assert [a.path for a in client.list_artifacts(run.info.run_id, "checkpoints")] == ["checkpoints/final.ckpt"]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["version"] == run.info.run_id and ranks[1]["version"] is None


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "config",
    [
        pytest.param({"fail_at": 1}, id="script-uncaught-exception"),
        pytest.param({"fail_at": 1, "fail_rank": 0, "strategy": "ddp_spawn", "devices": 2, "mode": "function"}, id="spawn-launch-function"),
    ],
)  # fmt: skip
def test_a_failing_run_is_marked_failed(tracking_uri, tmp_path, config):
    experiment = _experiment()
    config = {"loggers": {**LOGGER, "options": {"experiment_name": experiment}}, "steps": 3, **config}
    job, code = _run_job(tmp_path, config)
    assert code != 0 and "planned failure at step 1" in job.output()
    (run,) = _runs(tracking_uri, experiment)
    assert run.info.status == "FAILED"
    assert [m.step for m in MlflowClient(tracking_uri).get_metric_history(run.info.run_id, "loss")] == [0]
