"""Checkpoint tiers under real launchers: 4 DDP ranks as 2 simulated nodes (two ``fabric run`` agents on loopback,
a c10d rendezvous, each node with its own shared-memory folder and keeper), trained by ``scripts/tiers_train.py``.

* A node's ranks are SIGKILLed at step 7 with its keeper, and its memory folder wiped: after the restart every rank
  resumes at step 7 from memory (not from the disk checkpoint of step 5), the wiped node's ranks from their peer copies
  on the other node, and the run goes on exactly as an uninterrupted one (every later step's weights bit-identical).
* Then a node is lost for good (both agents taken down, one node's memory wiped): a new job on the surviving node
  resumes on 2 ranks from the 4-rank snapshots it holds (its own and the peer copies).
* SIGTERM to ``fabric run``: the workers save at the next step (memory and disk) and the job exits 75 (requeue); the
  requeued job resumes from that step's memory snapshot.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from jobs import Job, fabric_command, free_port, job_env, start_job, wait_until

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(sys.platform != "linux", reason="uses /proc and /dev/shm"),
    pytest.mark.skipif(importlib.util.find_spec("torchdata") is None, reason="needs torchdata's StatefulDataLoader"),
]

TRAIN = Path(__file__).parents[1] / "scripts" / "tiers_train.py"
TIMEOUT = 300
#: c10d rendezvous on a busy 2-core machine (as tests/plugins/elastic_scenarios.py on the elastic branch found):
#: generous heartbeats, and only one agent hosts the store (on loopback each would claim it).
RDZV_CONF = "keep_alive_interval=2,keep_alive_max_attempt=5,join_timeout=120"


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                fields = stat[stat.rindex(")") + 2 :].split()
                if fields[0] not in ("Z", "X"):
                    children.setdefault(int(fields[1]), []).append(int(entry))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def _kill(*pids: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _kill_tree(pid: int) -> None:
    """SIGKILL a job's main process and everything below it (torchrun starts each worker in a session of its own)."""
    _kill(pid, *_descendants(pid))


@pytest.fixture
def memory_dirs(tmp_path: Path):
    """Shared-memory folders for simulated nodes; their keepers are ended (by the pid they recorded) afterwards."""
    base = Path("/dev/shm") / f"fabric-test-{os.getpid()}-{tmp_path.name}"
    made: list[Path] = []

    def make(name: str) -> Path:
        folder = base / name
        made.append(folder)
        return folder

    yield make
    for folder in made:
        with contextlib.suppress(OSError, ValueError, KeyError):
            _kill(int(json.loads((folder / "keeper.json").read_text())["pid"]))
    shutil.rmtree(base, ignore_errors=True)


def _progress(out: Path) -> list[dict]:
    path = out / "progress.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _hashes(out: Path, attempt: int | None = None, world: int | None = None) -> dict[int, str]:
    return {
        r["step"]: r["hash"]
        for r in _progress(out)
        if "step" in r and (attempt is None or r["attempt"] == attempt) and (world is None or r["world"] == world)
    }


def _env(out: Path, memory: Path, node: str, **extra: str) -> dict[str, str]:
    return job_env(
        OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", FABRIC_RUN_DIR=str(out / "run"), FABRIC_MEMORY_DIR=str(memory),
        FABRIC_MEMORY_LINGER="300", TIERS_NODE=node, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", **extra,
    )  # fmt: skip


def _agent(out: Path, name: str, port: int, memory: Path, hosts_store: bool, **extra: str) -> Job:
    command = [
        *fabric_command(), "--num-nodes", "2", "--rdzv-backend", "c10d", "--main-port", port, "--max-restarts", "1",
        "--rdzv-conf", f"{RDZV_CONF},is_host={int(hosts_store)}", "--accelerator", "cpu", "--devices", "2", TRAIN, out,
    ]  # fmt: skip
    return start_job([str(c) for c in command], out / f"agent-{name}.log", _env(out, memory, name, **extra))


def _single(out: Path, name: str, memory: Path, devices: int, **extra: str) -> Job:
    command = [
        *fabric_command(), "--main-port", free_port(), "--accelerator", "cpu", "--devices", devices, TRAIN, out,
    ]  # fmt: skip
    return start_job([str(c) for c in command], out / f"{name}.log", _env(out, memory, "a", **extra))


def _parked(out: Path, tag: str, count: int) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((out / "pids").glob(f"{tag}-*.json"))] if (out / "pids").exists() else []


@pytest.mark.timeout(900)
def test_a_lost_node_resumes_from_peer_copies_and_a_node_lost_for_good_resumes_on_fewer_ranks(tmp_path: Path, memory_dirs):
    reference = tmp_path / "reference"
    reference.mkdir()
    job = _single(reference, "reference", memory_dirs("reference"), 4)
    assert job.wait(TIMEOUT) == 0, job.output()[-4000:]
    expected = _hashes(reference)
    assert sorted(expected) == list(range(1, 13))

    out = tmp_path / "killed"
    out.mkdir()
    shm_a, shm_b = memory_dirs("a"), memory_dirs("b")
    port = free_port()
    extra = {"TIERS_KILL_AT": "7", "TIERS_VICTIM": "b", "TIERS_STOP_AT": "10"}
    agents = {"a": _agent(out, "a", port, shm_a, True, **extra)}
    try:
        time.sleep(1.0)  # the store's host first
        agents["b"] = _agent(out, "b", port, shm_b, False, **extra)
        explain = lambda: "\n".join(f"--- agent {n} ---\n{j.output()[-3000:]}" for n, j in agents.items())  # noqa: E731
        assert wait_until(lambda: len(_parked(out, "kill", 4)) == 4, TIMEOUT), explain()

        # node b fails whole: its ranks and its keeper are SIGKILLed, its shared memory is wiped (a new machine)
        victims = [entry for entry in _parked(out, "kill", 4) if entry["node"] == "b"]
        assert len(victims) == 2
        _kill(*(v["pid"] for v in victims), victims[0]["keeper"])
        shutil.rmtree(shm_b)

        # both agents restart their workers (node a's failed in the barrier when b's died); they resume at step 7
        assert wait_until(lambda: len(_parked(out, "stop", 4)) == 4, TIMEOUT), explain()
        resumed = [r for r in _progress(out) if "resumed" in r and r["attempt"] == 1]
        assert len(resumed) == 1, _progress(out)
        assert resumed[0]["resumed"] == 7 and resumed[0]["latest"] == "mem://step-000000007", resumed
        assert resumed[0]["recovery"]["tier"] == "memory" and resumed[0]["hash"] == expected[7]
        # every rank of the wiped node got its state from the peer copy on node a; node a's ranks from their own memory
        sources = {(r["node"], r["rank"]): r["recovery"]["source"] for r in map(json.loads, (out / "sources-1").read_text().splitlines())}
        assert len(sources) == 4, sources
        assert all(("fetched" in source) == (node == "b") for (node, _), source in sources.items()), sources
        after = _hashes(out, attempt=1)
        assert after == {step: expected[step] for step in range(8, 11)}, (after, expected)

        # node b is lost for good: both agents go (a's keeper lingers with a's memory), b's memory is wiped again
        stopped = _parked(out, "stop", 4)
        _kill_tree(agents["b"].pid)
        _kill(*(v["keeper"] for v in stopped if v["node"] == "b"))
        _kill_tree(agents["a"].pid)
        shutil.rmtree(shm_b, ignore_errors=True)
    finally:
        for agent in agents.values():
            _kill_tree(agent.pid)

    # the job is requeued on the surviving node alone: 2 ranks restore the 4-rank snapshots of step 10 it holds
    job = _single(out, "requeued", shm_a, 2)
    assert job.wait(TIMEOUT) == 0, job.output()[-4000:]
    requeued = [r for r in _progress(out) if "resumed" in r and r["world"] == 2]
    assert len(requeued) == 1 and requeued[0]["resumed"] == 10, _progress(out)
    assert requeued[0]["latest"] == "mem://step-000000010" and requeued[0]["recovery"]["tier"] == "memory"
    assert requeued[0]["hash"] == expected[10]
    assert sorted(_hashes(out, world=2)) == [11, 12]
    assert (out / "final.pt").exists()
    assert torch.load(out / "final.pt").keys() == torch.load(reference / "final.pt").keys()


@pytest.mark.timeout(600)
def test_sigterm_saves_at_the_next_step_and_the_job_exits_for_a_requeue(tmp_path: Path, memory_dirs):
    # multiprocess-check: starts ranks (_single runs fabric run --devices 2)
    out = tmp_path / "preempted"
    out.mkdir()
    shm = memory_dirs("a")
    job = _single(out, "first", shm, 2, TIERS_STEPS="400", TIERS_PAUSE="0.2")
    assert wait_until(lambda: len(_hashes(out)) >= 3, TIMEOUT), job.output()[-3000:]
    os.kill(job.pid, signal.SIGTERM)  # what Kubernetes sends the container's main process; the agent tells its workers
    assert job.wait(120) == 75, job.output()[-4000:]

    events = json.loads((out / "run" / "checkpoints" / "recovery" / "attempt-0.json").read_text())
    preempted = [event for event in events if event["event"] == "preempted"]
    assert len(preempted) == 1, events
    step = preempted[0]["step"]
    assert max(_hashes(out)) == step - 1  # saved at the step boundary after the notice, before recording that step
    disk = out / "run" / "checkpoints" / f"step-{step:09d}.ckpt"
    assert preempted[0]["saved"] == [f"mem://step-{step:09d}", str(disk)] and disk.is_file()
    assert "SIGTERM: saved step" in job.output()

    # the requeued job resumes from that step's memory snapshot (the keeper kept it for a requeue)
    job = _single(out, "requeued", shm, 2, TIERS_STEPS=str(step + 2))
    assert job.wait(TIMEOUT) == 0, job.output()[-4000:]
    resumed = [r for r in _progress(out) if "resumed" in r and r["attempt"] == 1]
    assert resumed and resumed[0]["resumed"] == step and resumed[0]["latest"] == f"mem://step-{step:09d}", resumed
    assert sorted(s for s in _hashes(out, attempt=1)) == [step + 1, step + 2]
