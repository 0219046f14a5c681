"""``ft_ddp`` with 3 replica groups on a real lighthouse (loopback), all started by ``fabric run --launcher ft``, with
the sample ledger on. Replica group 1 stops inside a step (after joining its quorum, before its allreduce) and is
SIGKILLed there; the launcher starts it again. The step in flight is applied nowhere (the survivors' weights do not
move in it) and its samples are drawn again; groups 0 and 2 keep stepping meanwhile; the restarted group copies the
live state (weights, optimizer, torchft's step and the data position) from a peer, no checkpoint exists. At the end:
bit-identical weights in every group, a loss within noise of the best reachable, exactly one group wrote
``fabric.save``'s checkpoint, and the ledger shows every sample of every epoch trained exactly once, the samples of
the step that was not committed included. Every process is started here and must be gone at the end."""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import statistics
import subprocess
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
KILL_AT = 10  # replica group 1 is killed inside the first step from this one on with all groups in its quorum
START_TIMEOUT = 240  # importing torch and torchft in 4 processes on a loaded 2-core machine
STEP_TIMEOUT = 120


def _progress(folder: Path) -> list[dict]:
    return read_jsonl(folder / "progress.jsonl")


def _last_step(folder: Path) -> int:
    records = _progress(folder)
    return records[-1]["step"] if records else -1


def test_a_killed_replica_group_rejoins_and_every_sample_is_trained_once(tmp_path: Path):
    # multiprocess-check: starts ranks (a launcher, a lighthouse and 3 replica groups)
    out, stop, ledger = tmp_path / "out", tmp_path / "stop", tmp_path / "ledger"
    env = job_env(
        FT_TEST_PER_PROCESS="1", FT_TEST_STOP_IN_STEP=str(KILL_AT), FT_TEST_STOP_GROUP="1", FABRIC_SAMPLE_LEDGER=str(ledger),
        OMP_NUM_THREADS="1", FT_TEST_RESTART_DELAY="5",  # the replacement takes 5 s: groups 0 and 2 step in a quorum of 2
        FT_TEST_LOG="1",  # a CSV logger per process: the loss every step, the quorum metrics beside it
    )  # fmt: skip
    command = [*fabric_command(), "--launcher", "ft", "--ft-groups", "3", "--devices", "1", "--max-restarts", "1"]
    job = start_job([*command, "--accelerator", "cpu", str(TRAIN), str(out), str(stop), "0.02"], tmp_path / "job.log", env=env)

    wait = job.wait_for

    victim, survivors = out / "g1-a0-r0", [out / "g0-a0-r0", out / "g2-a0-r0"]
    wait((victim / "in_step").exists, START_TIMEOUT, f"group 1 inside step {KILL_AT}")
    in_flight = int((victim / "in_step").read_text())
    os.kill(int((victim / "pid").read_text()), signal.SIGKILL)  # a process of the job this test started
    killed_at = time.time()
    before = [_last_step(s) for s in survivors]

    # Groups 0 and 2 never stop: 20 more committed steps each while group 1 is away, in a quorum of two.
    wait(lambda: all(_last_step(s) >= b + 20 for s, b in zip(survivors, before)), STEP_TIMEOUT, "groups 0 and 2 stepping")
    for survivor in survivors:
        records = _progress(survivor)
        alone = [r for r in records if r["t"] > killed_at]
        assert any(r["participants"] == 2 and r["committed"] for r in alone), alone[:5]
        # The step in flight (they waited in its allreduce for group 1) failed and is applied nowhere; every committed
        # step moved the weights (the control), every step not committed left them alone (the job's first step
        # only synchronises the weights; a step whose batch was cut for a quorum that changed is drawn again).
        failed = [r for r in records if not r["committed"]]
        assert any(r["step"] == in_flight for r in failed), [r for r in records if abs(r["step"] - in_flight) < 3]
        assert not any(r["changed"] for r in failed), failed
        assert all(r["changed"] for r in records if r["committed"])

    restarted = out / "g1-a1-r0"
    wait(lambda: any(r["participants"] == 3 for r in _progress(restarted)), START_TIMEOUT, "group 1 back in the quorum")
    first = _progress(restarted)[0]
    assert first["step"] > in_flight, first  # it started from the live state, not from step 0
    # `fabric env` pointed at the job's lighthouse names the quorum of the three groups.
    lighthouse = re.search(r"registered with the lighthouse (http://\S+)", job.output()).group(1)
    fabric = Path(sys.executable).parent / "fabric"
    command = [str(fabric), "env"] if fabric.exists() else [sys.executable, "-m", "fabric_core.cli", "env"]
    env_out = subprocess.run(command, env=job_env(TORCHFT_LIGHTHOUSE=lighthouse), capture_output=True, text=True, timeout=120)
    assert "3 replica group(s): fabric_ft_0 at step" in env_out.stdout, env_out.stdout + env_out.stderr
    stop_at = max(max(_last_step(s) for s in survivors) + 15, 80)  # enough steps to come close to the optimum
    stop.write_text(str(stop_at))
    assert job.wait(STEP_TIMEOUT) == 0, job.output()[-6000:]
    assert not job.leftovers(), f"processes left behind:\n{job.output()[-2000:]}"

    finals = [torch.load(p / "final.pt") for p in (*survivors, restarted)]
    for weights in finals[1:]:
        for key, tensor in finals[0].items():
            assert torch.equal(tensor, weights[key]), f"{key} differs by {(tensor - weights[key]).abs().max()}"
    results = [json.loads((p / "result.json").read_text()) for p in (*survivors, restarted)]
    assert {r["step"] for r in results} == {stop_at}
    # Trained like a run that was never interrupted: within 0.2 % of the way from the initial loss to the optimum.
    result = results[0]
    assert result["loss"] - result["optimum"] <= 2e-3 * (result["initial_loss"] - result["optimum"]), result
    # fabric.save beside it: one group (the first of the last quorum) wrote the checkpoint, and it holds the weights.
    written = sorted(out.glob("checkpoint-g*.ckpt"))
    assert len(written) == 1, written
    saved = torch.load(written[0], weights_only=False)["model"]
    assert all(torch.equal(saved[k], finals[0][k]) for k in finals[0])

    # The sample ledger of all three groups and both attempts of group 1: every sample once, none lost, none twice,
    # in every epoch the job went through (the step in flight's samples were drawn again and trained once).
    from fabric_core.runtime.ledger import report

    book = report(ledger)
    epochs = book.loaders["loader0"]
    assert book.ok, book.text()
    assert len(epochs) >= 2 and all(e.trained == e.reached for e in epochs.values()), book.text()
    assert all(e.reached == e.size for epoch, e in epochs.items() if epoch < max(epochs)), book.text()

    # The quorum as metrics, beside the loss the script logs (`Strategy.metrics()`): group 0's CSV shows 3 groups, then
    # 2 while group 1 was away, then 3 again, and counts those changes.
    with open(survivors[0] / "logs" / "ft" / "version_0" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    sizes = [int(float(r["ft/quorum_size"])) for r in rows if r.get("ft/quorum_size")]
    runs = [size for i, size in enumerate(sizes) if i == 0 or size != sizes[i - 1]]
    assert runs[-3:] == [3, 2, 3] and all(r["loss"] for r in rows), runs
    assert float(rows[-1]["ft/quorum_changes"]) >= 2 and float(rows[-1]["ft/step"]) == stop_at, rows[-1]

    steps = _progress(survivors[0])
    gaps = [b["t"] - a["t"] for a, b in zip(steps, steps[1:])]
    around = [b["t"] - a["t"] for a, b in zip(steps, steps[1:]) if killed_at - 1 <= b["t"] <= killed_at + 30]
    print(
        f"\nft_ddp kill/rejoin (3 groups): group 0 median step {statistics.median(gaps) * 1e3:.1f} ms, longest pause after"
        f" the kill {max(around) * 1e3:.0f} ms; group 1 rejoined at step {first['step']}; ledger: {len(epochs)} epochs,"
        f" {sum(e.trained for e in epochs.values())} samples, each trained once"
    )
