"""DiLoCo across replica groups whose members come and go: ``ft_ddp`` with ``semi_sync="diloco"``, 2 groups, a
synchronisation every 5 inner steps, all started by ``fabric run --launcher ft`` with a real lighthouse on loopback.
Replica group 1 is SIGKILLed between two synchronisations and its replacement takes a few seconds to arrive: group 0
goes on (inner steps, and synchronisations with a quorum of one), the restarted group heals at the next
synchronisation it reaches with the live weights and outer optimizer, and both end bit-identical. The dead group's
inner steps since the last synchronisation are lost, not replayed (docs/decisions.md "Fault tolerance"); the final
loss is as close to the optimum as 3 uninterrupted runs (data orders from 3 seeds) that stop at the same
synchronisation (within twice the largest of their distances). Every process is started here and must be gone at the end."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from jobs import fabric_command, job_env, read_jsonl, start_job

pytestmark = [pytest.mark.multiprocess, pytest.mark.skipif(sys.platform != "linux", reason="uses /proc")]

pytest.importorskip("fabric_ft")
pytest.importorskip("torchft")

TRAIN = Path(__file__).parent / "scripts" / "ft_train.py"
KILL_AT = 4  # group 1 stops inside the first inner step after this synchronisation, with both groups in the quorum
START_TIMEOUT = 240  # importing torch and torchft in 3 processes on a loaded 2-core machine
STEP_TIMEOUT = 120
RESTART_DELAY = 6  # seconds the replacement of group 1 takes to arrive


def _progress(folder: Path) -> list[dict]:
    return read_jsonl(folder / "progress.jsonl")


def _command(out: Path, stop: Path, sleep: float) -> list[str]:
    command = [*fabric_command(), "--launcher", "ft", "--ft-groups", "2", "--devices", "1", "--max-restarts", "1"]
    return [*command, "--accelerator", "cpu", str(TRAIN), str(out), str(stop), str(sleep)]


def _uninterrupted_loss(folder: Path, seed: int, stop_at: int) -> float:
    out, stop = folder / "out", folder / "stop"
    stop.parent.mkdir(parents=True)
    stop.write_text(str(stop_at))
    env = job_env(FT_TEST_STRATEGY="diloco", FT_TEST_SYNC_EVERY="5", OMP_NUM_THREADS="1", PL_GLOBAL_SEED=str(seed))
    job = start_job(_command(out, stop, 0.0), folder / "job.log", env=env)
    assert job.wait(START_TIMEOUT) == 0, job.output()[-6000:]
    assert not job.leftovers(), f"processes left behind:\n{job.output()[-2000:]}"
    result = json.loads((out / "result.json").read_text())
    assert result["step"] == stop_at, result
    return result["loss"]


def test_a_group_killed_between_synchronisations_rejoins_at_the_next_one(tmp_path: Path):
    # multiprocess-check: starts ranks (a launcher, a lighthouse and 2 replica groups; then 3 uninterrupted jobs)
    out, stop = tmp_path / "out", tmp_path / "stop"
    env = job_env(
        FT_TEST_STRATEGY="diloco", FT_TEST_SYNC_EVERY="5", FT_TEST_PER_PROCESS="1", FT_TEST_STOP_IN_STEP=str(KILL_AT),
        FT_TEST_STOP_GROUP="1", FT_TEST_RESTART_DELAY=str(RESTART_DELAY), OMP_NUM_THREADS="1", PL_GLOBAL_SEED="0",
    )  # fmt: skip
    job = start_job(_command(out, stop, 0.05), tmp_path / "job.log", env=env)

    wait = job.wait_for

    victim, survivor, restarted = out / "g1-a0-r0", out / "g0-a0-r0", out / "g1-a1-r0"
    wait((victim / "in_step").exists, START_TIMEOUT, f"group 1 inside the window after synchronisation {KILL_AT}")
    killed_in = int((victim / "in_step").read_text())
    os.kill(int((victim / "pid").read_text()), signal.SIGKILL)  # a process of the job this test started
    killed_at = time.time()

    # Group 0 goes on: inner steps, and synchronisations in a quorum of one while group 1 is away.
    wait(lambda: any(r["participants"] == 1 for r in _progress(survivor)), STEP_TIMEOUT, "group 0 synchronising alone")
    alone = [r for r in _progress(survivor) if r["participants"] == 1]
    assert alone[0]["step"] > killed_in and alone[0]["t"] > killed_at, alone[:3]

    # The replacement heals at the next synchronisation it reaches: its first step ends with one, in a quorum of two,
    # at the live step (not from 0, not at the step it died in).
    wait(lambda: any(r["participants"] == 2 for r in _progress(restarted)), START_TIMEOUT, "group 1 back in the quorum")
    first = _progress(restarted)[0]
    assert first["local"] == 1 and first["participants"] == 2 and first["step"] > alone[-1]["step"] - 1, first
    assert first["step"] > killed_in + 1, (first, killed_in)
    stop_at = max(max(r["step"] for r in _progress(survivor)) + 3, 30)  # close to the optimum by then
    stop.write_text(str(stop_at))
    assert job.wait(STEP_TIMEOUT) == 0, job.output()[-6000:]
    assert not job.leftovers(), f"processes left behind:\n{job.output()[-2000:]}"
    assert "replica group 1 restarted (restart 1 of 1)" in job.output()

    finals = [torch.load(p / "final.pt") for p in (survivor, restarted)]
    for key, tensor in finals[0].items():
        assert torch.equal(tensor, finals[1][key]), f"{key} differs by {(tensor - finals[1][key]).abs().max()}"
    results = [json.loads((p / "result.json").read_text()) for p in (survivor, restarted)]
    assert {r["step"] for r in results} == {stop_at}

    # Trained like an uninterrupted run: its loss above the least-squares optimum at most twice the largest of 3
    # uninterrupted runs (data orders from 3 seeds) stopped at the same synchronisation. Not "between their min and
    # max": a fourth run of the same kind lands outside the range of three half the time. The interrupted run may
    # be closer to the optimum than all of them: while alone, group 0's shares are whole global batches (the data
    # follows the last quorum), so its inner steps see twice the samples of a step shared by two groups.
    losses = [_uninterrupted_loss(tmp_path / f"seed{seed}", seed, stop_at) for seed in range(3)]
    loss, optimum = results[0]["loss"], results[0]["optimum"]
    print(f"\nDiLoCo (H=5) kill/rejoin: loss {loss:.5f} at synchronisation {stop_at}; uninterrupted {losses}")
    assert loss - optimum <= 2 * max(u - optimum for u in losses), (loss, losses, optimum)
    assert loss < 0.5 * results[0]["initial_loss"]  # it trained
