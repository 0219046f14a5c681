"""HSDP whose replicas come and go: ``ft_fsdp`` (FSDP2 inside each replica group, torchft across) with 2 groups of 2
processes, all started by ``fabric run --launcher ft`` with a real lighthouse on loopback. One process of group 1 is
SIGKILLed: the launcher ends the rest of group 1 and starts the group again, group 0 keeps stepping alone meanwhile,
the restarted group copies the live state (each process its own shards) and takes part again, and every process of
both groups ends with bit-identical weights. The launcher exits 0 and leaves no process behind. The same with DDP inside
each group (``FaultTolerant("ddp", find_unused_parameters=True)``: the bucket averaged in the group, then across)."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest
import torch
from jobs import fabric_command, job_env, read_jsonl, start_job

pytestmark = [pytest.mark.multiprocess, pytest.mark.skipif(sys.platform != "linux", reason="uses /proc")]

pytest.importorskip("fabric_ft")
pytest.importorskip("fabric_fsdp")
pytest.importorskip("torchft")

TRAIN = Path(__file__).parent / "scripts" / "ft_train.py"
START_TIMEOUT = 240  # importing torch and torchft in 5 processes on a loaded 2-core machine
STEP_TIMEOUT = 120


def _progress(folder: Path) -> list[dict]:
    return read_jsonl(folder / "progress.jsonl")


def _last(folder: Path) -> dict:
    records = _progress(folder)
    return records[-1] if records else {"step": -1, "participants": 0}


@pytest.mark.parametrize("inside", ["ft_fsdp", "ft_ddp_group"], ids=["fsdp-inside", "ddp-inside"])
def test_one_process_of_a_replica_group_dies_and_its_group_rejoins(tmp_path: Path, inside: str):
    # multiprocess-check: starts ranks (a launcher, a lighthouse and 2 replica groups of 2 processes)
    out, stop = tmp_path / "out", tmp_path / "stop"
    # the replacement of group 1 takes 5 s to arrive: group 0 steps alone meanwhile (a quick restart could rejoin before
    # the lighthouse gives up on the dead group, and group 0 would never be alone)
    env = job_env(FT_TEST_STRATEGY=inside, FT_TEST_PER_PROCESS="1", FT_TEST_RESTART_DELAY="5", OMP_NUM_THREADS="1")
    command = [*fabric_command(), "--launcher", "ft", "--ft-groups", "2", "--devices", "2", "--max-restarts", "1"]
    command += ["--accelerator", "cpu", str(TRAIN), str(out), str(stop), "0.02"]
    job = start_job(command, tmp_path / "job.log", env=env)

    wait = job.wait_for

    victim = out / "g1-a0-r1"
    wait(lambda: _last(victim)["participants"] == 2 and _last(victim)["step"] >= 5, START_TIMEOUT, "both groups training")
    killed_at = _last(victim)["step"]
    os.kill(int((victim / "pid").read_text()), signal.SIGKILL)  # a process of the job this test started

    # Group 0 never stops: 15 more committed steps, in a quorum of one at some point.
    survivor = out / "g0-a0-r0"
    start = _last(survivor)["step"]
    wait(lambda: _last(survivor)["step"] >= start + 15, STEP_TIMEOUT, "group 0 stepping on")
    wait(lambda: any(r["participants"] == 1 and r["committed"] for r in _progress(survivor)), STEP_TIMEOUT, "group 0 alone")

    # The launcher restarted group 1 (both processes); it copies the live state and takes part again.
    restarted = [out / "g1-a1-r0", out / "g1-a1-r1"]
    wait(lambda: all(any(r["participants"] == 2 for r in _progress(p)) for p in restarted), START_TIMEOUT, "group 1 back")
    first = _progress(restarted[0])[0]
    assert first["step"] > killed_at, (first, killed_at)  # it started from the live state, not from step 0
    stop.write_text(str(_last(survivor)["step"] + 10))
    assert job.wait(STEP_TIMEOUT) == 0, job.output()[-6000:]
    assert not job.leftovers(), f"processes left behind:\n{job.output()[-2000:]}"
    assert "replica group 1 restarted (restart 1 of 1)" in job.output()

    finals = {p.name: torch.load(p / "final.pt") for p in (out / "g0-a0-r0", out / "g0-a0-r1", *restarted)}
    reference = finals["g0-a0-r0"]
    for name, weights in finals.items():
        for key, tensor in reference.items():
            assert torch.equal(tensor, weights[key]), f"{name}: {key} differs by {(tensor - weights[key]).abs().max()}"
    results = [json.loads((p / "result.json").read_text()) for p in (out / "g0-a0-r0", restarted[0])]
    assert results[0]["step"] == results[1]["step"]
    assert results[0]["loss"] < 0.1 * results[0]["initial_loss"]  # it trained
    # fabric.save beside it: the first group of the quorum wrote the checkpoint (sharded: a folder), the other did not.
    written = sorted(p.name for p in out.glob("checkpoint-g*.ckpt"))
    assert len(written) == 1 and (out / written[0]).is_dir() == (inside == "ft_fsdp"), written
