"""fabric-wandb with the real wandb package in offline mode, each run read back with ``wandb leet inspect``: in
this process, and as real jobs of 1 and 2 CPU processes."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from jobs import job_env, run_job
from wandb_runs import history, inspect_run, run_files

from fabric_core import Fabric
from fabric_wandb import WandbLogger

JOB = Path(__file__).parents[1] / "tracker_job.py"
STEP = "trainer/global_step"


def _run_job(tmp_path: Path, config: dict, timeout: float = 240, **env: str):
    return run_job([sys.executable, JOB, json.dumps(config)], tmp_path / "job.log", timeout, env=job_env(OMP_NUM_THREADS="1", **env))


def test_config_metrics_and_finish_read_back(tmp_path):
    logger = WandbLogger(project="vision", name="first", save_dir=tmp_path, id="run0001")
    assert (logger.name, logger.version) == ("vision", "run0001")
    fabric = Fabric(accelerator="cpu", loggers=logger)
    assert run_files(tmp_path) == []  # nothing started before the first log call

    fabric.logger.log_hyperparams({"lr": 0.1, "optimizer": {"name": "adamw"}, "loss_fn": torch.nn.functional.mse_loss})
    for step in (0, 10, 20):
        fabric.log_dict({"train/loss": torch.tensor(1.0 / (step + 1))}, step=step)
    fabric.log("val/loss", 0.5, step=10)  # an earlier step after a later one is kept (the x-axis is a metric)
    fabric.teardown()

    (path,) = run_files(tmp_path)
    summary, records = inspect_run(path)
    assert (summary["project"], summary["name"], summary["run_id"]) == ("vision", "first", "run0001")
    assert (summary["state"], summary["exit_code"]) == ("finished", 0)
    assert summary["config"] == {"lr": 0.1, "optimizer": {"name": "adamw"}, "loss_fn": "mse_loss"}
    rows = history(records)
    assert [(row[STEP], row.get("train/loss")) for row in rows[:3]] == [(0, 1.0), (10, pytest.approx(1 / 11)), (20, pytest.approx(1 / 21))]
    assert (rows[3][STEP], rows[3]["val/loss"]) == (10, 0.5)


def test_checkpoints_become_model_artifact_versions(tmp_path):
    logger = WandbLogger(project="p", save_dir=tmp_path, log_checkpoints=True, checkpoint_name="weights")
    fabric = Fabric(accelerator="cpu", loggers=logger)
    fabric.log("loss", 1.0, step=0)
    model = torch.nn.Linear(3, 2)
    fabric.save(tmp_path / "ckpt" / "last.ckpt", {"model": model}).wait()
    content = (tmp_path / "ckpt" / "last.ckpt").read_bytes()
    logger.finalize("success")

    (path,) = run_files(tmp_path)
    _, records = inspect_run(path)
    (artifact,) = [r["artifact"] for r in records if r["type"] == "artifact"]
    assert (artifact["name"], artifact["type"], artifact["aliases"]) == ("weights", "model", ["latest"])
    (entry,) = artifact["manifest"]["contents"]
    assert entry["path"] == "last.ckpt"
    assert entry["digest"] == base64.b64encode(hashlib.md5(content).digest()).decode()  # the committed file


def test_finalize_is_idempotent_and_a_run_that_never_started_stays_absent(tmp_path):
    logger = WandbLogger(project="p", save_dir=tmp_path)
    logger.finalize("success")
    assert run_files(tmp_path) == []
    logger.log_metrics({"x": 1.0})
    logger.finalize("failed")
    logger.finalize("success")  # the run is finished once, as failed
    summary, _ = inspect_run(run_files(tmp_path)[0])
    assert (summary["state"], summary["exit_code"]) == ("failed", 1)
    with pytest.raises(ValueError, match="Unknown run status 'done'"):
        logger.finalize("done")


def test_version_and_id_must_agree():
    with pytest.raises(ValueError, match="name the run twice"):
        WandbLogger(version="a", id="b")


@pytest.mark.multiprocess
def test_two_processes_only_rank_zero_logs(tmp_path):
    # multiprocess-check: starts ranks (the job's config asks for 2 devices)
    save_dir = tmp_path / "runs"
    options = {"project": "ddp", "save_dir": str(save_dir), "log_checkpoints": True}
    config = {
        "loggers": {"wandb": options}, "strategy": "ddp", "devices": 2,  # by name, with options
        "steps": 3, "checkpoint": str(tmp_path / "final.ckpt"), "out": str(tmp_path),
    }  # fmt: skip
    job, code = _run_job(tmp_path, config)
    assert code == 0, job.output()[-4000:]
    (path,) = run_files(save_dir)  # one run, not one per rank
    summary, records = inspect_run(path)
    assert (summary["state"], summary["exit_code"]) == ("finished", 0)  # nobody called finalize: closed at exit
    assert [row["rank"] for row in history(records) if "rank" in row] == [0, 0, 0]
    assert summary["config"]["world_size"] == 2
    assert [r["artifact"]["name"] for r in records if r["type"] == "artifact"] == [f"model-{summary['run_id']}"]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["version"] == summary["run_id"] and ranks[1]["version"] is None


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "config",
    [
        pytest.param({"fail_at": 1}, id="script-uncaught-exception"),
        pytest.param({"fail_at": 1, "fail_rank": 0, "strategy": "ddp_spawn", "devices": 2, "mode": "function"}, id="spawn-launch-function"),
    ],
)  # fmt: skip
def test_a_failing_run_is_marked_failed(tmp_path, config):
    save_dir = tmp_path / "runs"
    config = {"loggers": {"class": "fabric_wandb:WandbLogger", "options": {"save_dir": str(save_dir)}}, "steps": 3, **config}
    job, code = _run_job(tmp_path, config)
    assert code != 0 and "planned failure at step 1" in job.output()
    (path,) = run_files(save_dir)
    summary, records = inspect_run(path)
    assert (summary["state"], summary["exit_code"]) == ("failed", 1)
    assert [row[STEP] for row in history(records) if "loss" in row] == [0]


LIGHTNING_SITE = Path(sys.prefix) / "lightning-site"


@pytest.mark.skipif(not LIGHTNING_SITE.is_dir(), reason="`make setup` installs lightning into .venv/lightning-site")
def test_the_wandb_sdks_own_fabric_logger_is_accepted(tmp_path):
    """W&B ships a Fabric logger for the well-known Fabric (``wandb.integration.lightning.fabric``); a codebase that
    passes it to ``Fabric(loggers=...)`` works here unchanged. (It needs the ``lightning`` package, installed into a
    separate folder so its own ``fabric`` script does not replace ours.)"""
    save_dir = tmp_path / "runs"
    options = {"project": "sdk", "save_dir": str(save_dir)}
    config = {"loggers": {"class": "wandb.integration.lightning.fabric:WandbLogger", "options": options}, "steps": 3, "out": str(tmp_path)}
    job, code = _run_job(tmp_path, config, PYTHONPATH=os.pathsep.join([str(LIGHTNING_SITE), os.environ.get("PYTHONPATH", "")]))
    assert code == 0, job.output()[-4000:]
    assert json.loads((tmp_path / "rank0.json").read_text())["logger"] == "WandbLogger"
    (path,) = run_files(save_dir)
    summary, records = inspect_run(path)
    run_records = [r["run"] for r in records if r["type"] == "run"]
    assert run_records and run_records[0]["project"] == "sdk", (summary, run_records)
    assert (summary["state"], summary["exit_code"]) == ("finished", 0)  # closed by wandb's own exit hook in the job
    assert summary["config"]["lr"] == 0.1
    assert [row["trainer/global_step"] for row in history(records) if "loss" in row] == [0, 1, 2]
