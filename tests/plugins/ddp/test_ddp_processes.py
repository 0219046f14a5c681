"""fabric-ddp with real processes and real torch.distributed (gloo): every way of starting a 2-process job.

The ranks run ``scripts/ddp_checks.py``, which asserts what one rank can judge (collectives, gradient sync,
checkpoints) and writes ``rank<N>.json`` for the comparisons across ranks made here.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from jobs import fabric_command, free_port, job_env, run_job, start_job

SCRIPTS = Path(__file__).parent / "scripts"

pytestmark = [pytest.mark.multiprocess, pytest.mark.skipif(sys.platform != "linux", reason="uses /proc")]

CHECKS = SCRIPTS / "ddp_checks.py"
TIMEOUT = 240  # generous for a loaded 2-core machine; a healthy run takes a small fraction of it


def _ranks(outdir: Path) -> tuple[dict, dict]:
    return tuple(json.loads((outdir / f"rank{r}.json").read_text()) for r in (0, 1))  # type: ignore[return-value]


def _expected_threads() -> int:
    return max(1, (os.cpu_count() or 1) // 2)


def test_script_with_subprocess_launcher(tmp_path: Path):
    """`python script.py` with strategy="ddp", devices=2: the full set of checks."""
    job, code = run_job([sys.executable, CHECKS, "launch", tmp_path], tmp_path / "log.txt", TIMEOUT)
    assert code == 0, job.output()[-4000:]
    r0, r1 = _ranks(tmp_path)

    # The user's process is rank 0; rank 1 was started by the launcher.
    assert r0["pid"] == job.pid and r1["pid"] != job.pid
    assert (r0["launcher_child"], r1["launcher_child"]) == (None, "1")
    assert [r0["local_rank"], r1["local_rank"]] == [0, 1]
    assert r0["strategy"] == r1["strategy"] == "DDPStrategy"
    assert r0["threads"] == r1["threads"] == _expected_threads()
    assert r0["barrier_wait_s"] > 0.2  # rank 0 waited in the barrier for the late rank 1

    assert r0["grads_equal_after_sync"] and r1["grads_equal_after_sync"]
    assert not r0["grads_equal_in_no_sync"]
    assert r0["checkpoint_keys"] == ["0.bias", "0.weight", "2.bias", "2.weight"]
    # Rank 0 alone wrote the checkpoint; every rank read it.
    assert sorted((tmp_path / "io.log").read_text().splitlines()) == ["load 0", "load 1", "save 0"]

    # Each epoch, the ranks see disjoint halves of the data, and the shuffling changes between epochs.
    for epoch in (0, 1):
        first, second = r0["epochs"][epoch], r1["epochs"][epoch]
        assert not set(first) & set(second)
        assert sorted(first + second) == list(range(16))
    assert r0["epochs"][0] != r0["epochs"][1]
    # DataLoader workers are seeded per rank: their random draws (torch and `random`) differ across ranks.
    draws0, draws1 = r0["worker_draws"], r1["worker_draws"]
    assert all(a[0] != b[0] and a[1] != b[1] for a, b in zip(draws0, draws1)), (draws0, draws1)


def test_spawn_returns_rank_zero_result(tmp_path: Path):
    """strategy="ddp_spawn": launch(fn) runs fn in two new processes and returns rank 0's result."""
    job, code = run_job([sys.executable, CHECKS, "spawn", tmp_path, "--quick"], tmp_path / "log.txt", TIMEOUT)
    assert code == 0, job.output()[-4000:]
    result = json.loads((tmp_path / "spawn_result.json").read_text())
    assert result == {"rank": 0, "tensor": [0, 10, 20], "pid": job.pid, "untouched": True}
    r0, r1 = _ranks(tmp_path)
    assert r0["unshared"] and r1["unshared"]  # a CPU model passed to launch() is private to each worker
    assert job.pid not in (r0["pid"], r1["pid"])  # both ranks ran in workers, not in the caller
    assert [r0["rank"], r1["rank"]] == [0, 1] and r0["strategy"] == "DDPStrategy"


def test_fabric_run_cli(tmp_path: Path):
    """`fabric run --devices 2 script.py ...`: torch's elastic agent starts the ranks, Fabric() joins them."""
    port = free_port()
    command = [
        *fabric_command(),
        "--accelerator",
        "cpu",
        "--devices",
        "2",
        "--main-port",
        port,
        CHECKS,
        "cli",
    ]
    job, code = run_job([*command, tmp_path, "--quick"], tmp_path / "log.txt", TIMEOUT)
    assert code == 0, job.output()[-4000:]
    r0, r1 = _ranks(tmp_path)
    assert [r0["rank"], r1["rank"]] == [0, 1] and r0["world_size"] == 2
    assert r0["strategy"] == "DDPStrategy"  # "auto" picked DDP for 2 devices
    assert r0["threads"] == r1["threads"] == _expected_threads()
    assert job.pid not in (r0["pid"], r1["pid"])


def test_fabric_run_options_after_the_script(tmp_path: Path):
    """As in the seeds (`fabric run train_fabric.py --accelerator=gpu --devices=4`): options after SCRIPT are
    Fabric's; `--` hands the rest to the script."""
    command = [
        *fabric_command(), CHECKS, "cli", "--devices=2", "--accelerator", "cpu", "--strategy", "ddp",
        "--main-port", free_port(), tmp_path, "--", "--quick",
    ]  # fmt: skip
    job, code = run_job(command, tmp_path / "log.txt", TIMEOUT)
    assert code == 0, job.output()[-4000:]
    r0, r1 = _ranks(tmp_path)
    assert [r0["rank"], r1["rank"]] == [0, 1] and r0["world_size"] == 2 and r0["strategy"] == "DDPStrategy"


def test_two_nodes_on_loopback(tmp_path: Path):
    """Two `fabric run --num-nodes 2 --node-rank i` started side by side form one job of world size 2."""
    port = free_port()
    jobs = []
    for node in (0, 1):
        command = [
            *fabric_command(), "--accelerator", "cpu", "--devices", "1", "--num-nodes", "2",
            "--node-rank", node, "--main-address", "127.0.0.1", "--main-port", port, CHECKS, "cli", tmp_path,
            "--quick",
        ]  # fmt: skip
        jobs.append(start_job(command, tmp_path / f"node{node}.txt", env=job_env()))
    for job in jobs:
        assert job.wait(TIMEOUT) == 0, job.output()[-4000:]
        assert not job.leftovers()
    r0, r1 = _ranks(tmp_path)
    assert [r0["node_rank"], r1["node_rank"]] == [0, 1]
    assert [r0["local_rank"], r1["local_rank"]] == [0, 0]
    assert r0["world_size"] == r1["world_size"] == 2
