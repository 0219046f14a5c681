"""Elastic restart + resume: a 2-process job whose rank 1 is SIGKILLed in the middle of training restarts
(``fabric run --max-restarts 2``), resumes from the last committed checkpoint and ends with exactly the weights of
a run that was never interrupted (CPU, fixed seeds; model, optimizer, loader position mid-epoch, dropout's
generators)."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
import torch
from jobs import fabric_command, free_port, job_env, run_job

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(sys.platform != "linux", reason="uses /proc"),
    pytest.mark.skipif(importlib.util.find_spec("torchdata") is None, reason="needs torchdata's StatefulDataLoader"),
]

TRAIN = Path(__file__).parent / "scripts" / "resume_train.py"
TIMEOUT = 300  # two attempts of two torch processes on a loaded 2-core machine


def _train(out: Path, strategy: str, kill_at: int) -> str:
    out.mkdir()
    command = [*fabric_command(), "--accelerator", "cpu", "--strategy", strategy, "--devices", "2"]
    command += ["--main-port", free_port(), "--max-restarts", "2", TRAIN, out, kill_at]
    job, code = run_job([str(c) for c in command], out / "log.txt", TIMEOUT, env=job_env(OMP_NUM_THREADS="1"))
    assert code == 0, job.output()[-4000:]
    return job.output()


@pytest.mark.parametrize(("strategy", "kill_at", "resumed_at"), [("ddp", 7, 6), ("fsdp", 11, 9)])
def test_a_killed_rank_restarts_resumes_and_ends_with_the_uninterrupted_weights(
    tmp_path: Path, strategy: str, kill_at: int, resumed_at: int
):
    pytest.importorskip(f"fabric_{strategy}")
    _train(tmp_path / "reference", strategy, kill_at=-1)
    output = _train(tmp_path / "killed", strategy, kill_at=kill_at)

    # rank 1 really SIGKILLed itself and the agent restarted the workers. Which failure torchelastic's log names
    # first is a race (rank 1's -9, or rank 0's -15 from the agent's SIGTERM after its gloo peer vanished).
    assert (tmp_path / "killed" / "killed.txt").exists()
    assert re.search(r"failed \(exitcode: -(9|15)\) local_rank: [01]", output), output[-4000:]
    first = json.loads((tmp_path / "killed" / "attempt0.json").read_text())
    second = json.loads((tmp_path / "killed" / "attempt1.json").read_text())
    assert first == {"resumed_from": None, "step": 0}
    assert second["step"] == resumed_at and second["resumed_from"].endswith(f"step-{resumed_at:04d}.ckpt")
    assert not (tmp_path / "killed" / "attempt2.json").exists()
    assert sorted(p.name for p in (tmp_path / "killed" / "ckpts").iterdir()) == ["step-0015.ckpt", "step-0018.ckpt"]

    reference = torch.load(tmp_path / "reference" / "final.pt")
    resumed = torch.load(tmp_path / "killed" / "final.pt")
    assert reference.keys() == resumed.keys() and reference
    for name, tensor in reference.items():
        assert torch.equal(tensor, resumed[name]), f"{name} differs by {(tensor - resumed[name]).abs().max()}"
