"""``ft_ddp`` on a real lighthouse (started here, on loopback) with 2 replica groups on CPU: replica group 1 is
SIGKILLed inside a step (after joining its quorum, before its allreduce) and restarted; the step in flight is
applied nowhere (group 0's weights do not move in it); group 0 keeps stepping alone meanwhile, group 1 rejoins by copying the live
state from group 0 (no checkpoint exists), and both end with bit-identical weights and, like a run that was never
interrupted, a loss within noise of the best one reachable. Every process is started here and must be gone at the end."""

from __future__ import annotations

import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path

import pytest
import torch
from jobs import Job, free_port, job_env, start_job, wait_until

pytestmark = [pytest.mark.multiprocess, pytest.mark.skipif(sys.platform != "linux", reason="uses /proc")]

pytest.importorskip("fabric_ft")
pytest.importorskip("torchft")

TRAIN = Path(__file__).parent / "scripts" / "ft_train.py"
KILL_AT = 10  # replica group 1 is killed inside the first step from this one on with both groups in its quorum
START_TIMEOUT = 180  # importing torch and torchft in 2-3 processes on a loaded 2-core machine
STEP_TIMEOUT = 90


def _lighthouse(tmp_path: Path) -> tuple[Job, str]:
    port = free_port()
    binary = Path(sys.executable).parent / "torchft_lighthouse"
    # min_replicas 1: one live group is a quorum, so a survivor goes on alone.
    # heartbeat_timeout_ms: how long the lighthouse waits for a silent group before it forms a quorum without it.
    command = [binary, "--bind", f"127.0.0.1:{port}", "--min_replicas", "1", "--join_timeout_ms", "2000"]
    command += ["--heartbeat_timeout_ms", "2000"]
    return start_job(command, tmp_path / "lighthouse.log"), f"http://127.0.0.1:{port}"


def _replica(
    tmp_path: Path, name: str, group: int, lighthouse: str, stop: Path, sleep: float = 0.02, stop_in_step: int = -1
) -> Job:
    env = job_env(TORCHFT_LIGHTHOUSE=lighthouse, REPLICA_GROUP_ID=str(group), NUM_REPLICA_GROUPS="2", OMP_NUM_THREADS="1")
    env["FT_TEST_STOP_IN_STEP"] = str(stop_in_step)
    command = [sys.executable, TRAIN, tmp_path / name, stop, sleep]
    return start_job(command, tmp_path / f"{name}.log", env=env)


def _progress(tmp_path: Path, name: str) -> list[dict]:
    path = tmp_path / name / "progress.jsonl"
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # the line being written
            break
    return records


def _last_step(tmp_path: Path, name: str) -> int:
    records = _progress(tmp_path, name)
    return records[-1]["step"] if records else -1


def _finish(jobs: list[Job], lighthouse: Job, timeout: float = STEP_TIMEOUT) -> None:
    for job in jobs:
        assert job.wait(timeout) == 0, job.output()[-4000:]
    lighthouse.process.terminate()
    lighthouse.wait(30)
    for job in [*jobs, lighthouse]:
        assert not job.leftovers(), f"processes left behind:\n{job.output()[-2000:]}"


def _wait(condition, timeout: float, what: str, jobs: list[Job]) -> None:
    if not wait_until(condition, timeout, interval=0.1):
        logs = "\n".join(f"--- {job.log.name}\n{job.output()[-2500:]}" for job in jobs)
        pytest.fail(f"timed out after {timeout} s waiting for {what}\n{logs}")


def test_a_killed_replica_group_rejoins_while_the_other_keeps_training(tmp_path: Path):
    # multiprocess-check: starts ranks (2 replica groups and a lighthouse)
    stop = tmp_path / "stop"
    lighthouse, address = _lighthouse(tmp_path)
    r0 = _replica(tmp_path, "r0", 0, address, stop)
    r1 = _replica(tmp_path, "r1", 1, address, stop, stop_in_step=KILL_AT)
    everyone = [lighthouse, r0, r1]

    _wait((tmp_path / "r1" / "in_step").exists, START_TIMEOUT, f"group 1 inside step {KILL_AT}", everyone)
    in_flight = int((tmp_path / "r1" / "in_step").read_text())
    os.kill(r1.pid, signal.SIGKILL)  # the process this test started
    assert r1.process.wait(10) == -signal.SIGKILL
    killed_at = time.time()
    r0_at_kill = _last_step(tmp_path, "r0")

    # Group 0 never stops: 20 more committed steps with group 1 gone, in a quorum of one.
    _wait(lambda: _last_step(tmp_path, "r0") >= r0_at_kill + 20, STEP_TIMEOUT, "group 0 stepping alone", everyone)
    alone = [r for r in _progress(tmp_path, "r0") if r["t"] > killed_at]
    assert any(r["participants"] == 1 and r["committed"] for r in alone), alone[:5]
    # The step in flight (group 0 waited in its allreduce for group 1) failed and is applied nowhere: group 0 did not
    # commit it and its weights did not move; group 1 died in it, and its restart copies group 0's state. Every
    # committed step did move the weights (the control).
    records = _progress(tmp_path, "r0")
    failed = [r for r in records if not r["committed"]]
    assert failed and failed[0]["step"] == in_flight, [r for r in records if abs(r["step"] - in_flight) < 3]
    assert not any(r["changed"] for r in failed), failed
    assert all(r["changed"] for r in records if r["committed"]), [r for r in records if r["committed"] and not r["changed"]]

    r1b = _replica(tmp_path, "r1b", 1, address, stop)
    everyone.append(r1b)
    restarted_at = time.time()
    rejoined = lambda: any(r["participants"] == 2 for r in _progress(tmp_path, "r1b"))  # noqa: E731
    _wait(rejoined, START_TIMEOUT, "the restarted group 1 back in the quorum", everyone)
    r0_at_rejoin = _last_step(tmp_path, "r0")
    assert r0_at_rejoin > r0_at_kill + 20

    # The restarted group started from the live state (torchft's step counter included), not from step 0.
    first = _progress(tmp_path, "r1b")[0]
    assert first["step"] > in_flight + 20, first

    stop_at = r0_at_rejoin + 10
    stop.write_text(str(stop_at))
    _finish([r0, r1b], lighthouse)

    weights = [torch.load(tmp_path / name / "final.pt") for name in ("r0", "r1b")]
    assert weights[0].keys() == weights[1].keys() and weights[0]
    for key, tensor in weights[0].items():
        assert torch.equal(tensor, weights[1][key]), f"{key} differs by {(tensor - weights[1][key]).abs().max()}"
    results = [json.loads((tmp_path / name / "result.json").read_text()) for name in ("r0", "r1b")]
    assert results[0]["step"] == results[1]["step"] == stop_at

    # fabric.save beside it: exactly one group (the first of the quorum) wrote the checkpoint, and it holds the
    # final weights.
    written = [p for name in ("r0", "r1b") for p in (tmp_path / name).glob("checkpoint-g*.ckpt")]
    assert len(written) == 1, written
    saved = torch.load(written[0], weights_only=False)["model"]
    assert all(torch.equal(saved[k], weights[0][k]) for k in weights[0])

    # What the failure cost group 0: its longest pause between two steps around the kill, against its usual step.
    steps = _progress(tmp_path, "r0")
    gaps = [b["t"] - a["t"] for a, b in zip(steps, steps[1:])]
    around = [b["t"] - a["t"] for a, b in zip(steps, steps[1:]) if killed_at - 1 <= b["t"] <= killed_at + 30]
    print(
        f"\nft_ddp kill/rejoin: group 0 median step {statistics.median(gaps) * 1e3:.1f} ms, longest pause after the"
        f" kill {max(around) * 1e3:.0f} ms; group 0 committed {r0_at_rejoin - r0_at_kill} steps while group 1 was"
        f" gone ({restarted_at - killed_at:.1f} s until its restart, rejoined at step {first['step']})"
    )

    # Against a run that was never interrupted, to the same step (without the pause between steps that kept the step
    # count of the run above bounded): both final losses lie within noise of the optimum (so of each other), judged
    # on the training's own scale, the way from the initial loss (~10) to the least-squares optimum (~0.0096). A
    # bound relative to the loss itself failed once at 25.5 % (0.0132 vs 0.0105): group 0 trains alone on its half of
    # the data and the job stops 10 steps after the rejoin, a little further from the optimum than the other run.
    reference = tmp_path / "reference"
    reference.mkdir()
    stop_ref = reference / "stop"
    stop_ref.write_text(str(stop_at))
    lighthouse, address = _lighthouse(reference)
    jobs = [_replica(reference, f"g{group}", group, address, stop_ref, sleep=0.0) for group in (0, 1)]
    _finish(jobs, lighthouse, timeout=START_TIMEOUT + stop_at * 0.05)
    uninterrupted = json.loads((reference / "g0" / "result.json").read_text())["loss"]
    scale = results[0]["initial_loss"] - results[0]["optimum"]
    print(f"final loss {results[0]['loss']:.5f} (uninterrupted {uninterrupted:.5f}, optimum {results[0]['optimum']:.5f})")
    for loss in (results[0]["loss"], uninterrupted):  # both trained: within 0.2 % of the way to the optimum
        assert loss - results[0]["optimum"] <= 2e-3 * scale, (loss, results[0]["optimum"], scale)
