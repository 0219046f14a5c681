"""A LightningModule handed to our Fabric gets the Fabric, as the reference hands itself to one (issue 31).

The module comes from the real ``lightning`` package (``make setup`` installs it into ``.venv/lightning-site``, apart
from the venv so its own ``fabric`` script does not replace ours); the job runs in its own processes.
"""

import csv
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from jobs import run_script

from fabric_core import Fabric

LIGHTNING_SITE = Path(sys.prefix) / "lightning-site"
SCRIPT = Path(__file__).parent / "scripts" / "lightning_module_job.py"
needs_lightning = pytest.mark.skipif(not LIGHTNING_SITE.is_dir(), reason="`make setup` installs lightning into .venv/lightning-site")


def _run(tmp_path: Path, strategy: str, devices: int, method: str) -> list[dict]:
    pythonpath = os.pathsep.join([str(LIGHTNING_SITE), os.environ.get("PYTHONPATH", "")])
    run_script(SCRIPT, str(tmp_path), strategy, str(devices), method, tmp_path=tmp_path, timeout=180, env={"PYTHONPATH": pythonpath})
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(devices)]


def _logged(log_dir: str) -> list[dict]:
    with open(Path(log_dir) / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


@needs_lightning
@pytest.mark.parametrize("method", ["setup", "setup_module"])
def test_a_lightning_module_logs_and_hooks_through_fabric(tmp_path, method):
    # multiprocess-check: single process (devices=1)
    (seen,) = _run(tmp_path, "auto", 1, method)
    assert seen["fabric_is_ours"] and seen["trainer_rank"] == 0
    assert seen["optimizers_is_wrapped"], "setup() hands the wrapped optimizers; setup_module() none (as the reference)"
    assert seen["in_callbacks"] == 1
    expected = ["on_after_setup", "on_train_epoch_end:0"] if method == "setup" else ["on_train_epoch_end:0"]
    assert seen["hooks"] == expected  # setup_module fires no on_after_setup (the reference's quirk)
    rows = _logged(seen["log_dir"])
    assert [bool(r["train_loss"]) for r in rows if r.get("train_loss")] == [True] * 3
    assert len([r for r in rows if r.get("twice")]) == 3


@pytest.mark.multiprocess
@needs_lightning
def test_a_lightning_module_under_ddp_on_two_processes(tmp_path):
    seen = _run(tmp_path, "ddp", 2, "setup")
    assert [s["hooks"][-1] for s in seen] == ["on_train_epoch_end:0", "on_train_epoch_end:1"]
    assert all(s["fabric_is_ours"] and s["optimizers_is_wrapped"] for s in seen)
    assert len([r for r in _logged(seen[0]["log_dir"]) if r.get("train_loss")]) == 3  # the CSV logger writes on rank 0


def test_a_plain_module_is_left_alone():
    """Only a module that asks (a ``_fabric`` attribute) gets the Fabric and joins the callbacks."""
    fabric = Fabric(accelerator="cpu")
    model = torch.nn.Linear(2, 2)
    fabric.setup(model)
    assert "_fabric" not in vars(model) and fabric._callbacks == []


def test_a_module_that_asks_joins_the_callbacks_once():
    class Asks(torch.nn.Linear):
        _fabric = None

    fabric = Fabric(accelerator="cpu", callbacks=[])
    first, second = Asks(2, 2), Asks(2, 2)
    fabric.setup(first, torch.optim.SGD(first.parameters(), lr=0.1))
    fabric.setup_module(second)
    assert first._fabric is fabric and second._fabric is fabric
    assert len(first._fabric_optimizers) == 1 and "_fabric_optimizers" not in vars(second)
    assert fabric._callbacks == [first, second]
