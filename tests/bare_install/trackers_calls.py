"""The trackers in the bare venv: after ``pip install fabric-wandb fabric-mlflow`` (and nothing else), both loggers
work by name, with no import of theirs in the script, and their runs read back with their own clients.

    python trackers_calls.py OUT_DIR

MLflow writes to a file store in OUT_DIR (the client alone, as ``mlflow-skinny`` installs it, has no server and no
database driver; ``MLFLOW_ALLOW_FILE_STORE=true`` allows it); wandb runs offline in OUT_DIR. Prints
``trackers-calls ok`` when everything checked out.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

out = Path(sys.argv[1]).resolve()
os.environ.update(
    MLFLOW_ALLOW_FILE_STORE="true", WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DIR=str(out / "wandb-dir"),
    WANDB_CACHE_DIR=str(out / "wandb-cache"), WANDB_DATA_DIR=str(out / "wandb-data"), WANDB_CONFIG_DIR=str(out / "wandb-config"),
)  # fmt: skip
for folder in ("wandb-dir", "wandb-cache", "wandb-data", "wandb-config", "wandb-runs"):
    (out / folder).mkdir(parents=True, exist_ok=True)

from fabric_core import Fabric  # noqa: E402 (after the environment is set)

uri = (out / "mlruns").as_uri()
fabric = Fabric(
    accelerator="cpu",
    loggers=[{"mlflow": {"tracking_uri": uri, "experiment_name": "bare"}}, {"wandb": {"project": "bare", "save_dir": str(out / "wandb-runs")}}],
)
for logger in fabric.loggers:
    logger.log_hyperparams({"lr": 0.5})
for step in range(3):
    fabric.log("loss", 1.0 / (step + 1), step=step)
mlflow_logger, wandb_logger = fabric.loggers
fabric.teardown()

from mlflow.tracking import MlflowClient  # noqa: E402 (reading back, with MLflow's own client)

client = MlflowClient(uri)
run = client.get_run(mlflow_logger.version)
history = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")]
assert (run.info.status, run.data.params, history) == ("FINISHED", {"lr": "0.5"}, [(0, 1.0), (1, 0.5), (2, 1 / 3)]), (run, history)

(run_file,) = glob.glob(str(out / "wandb-runs" / "wandb" / "offline-run-*" / "run-*.wandb"))
wandb_cli = [sys.executable, "-c", "import sys; from wandb.cli.cli import cli; sys.exit(cli())"]
summary = json.loads(subprocess.run([*wandb_cli, "leet", "inspect", "--summary", "--json", run_file], capture_output=True, text=True, check=True, timeout=300).stdout)
assert (summary["state"], summary["project"], summary["config"]["lr"]) == ("finished", "bare", 0.5), summary
print("trackers-calls ok", flush=True)
