"""Elastic scenarios as real jobs, shared by the tests (which judge them) and the ``elastic`` benchmark section (which
times them): a restart on fewer ranks, ``fabric run --num-nodes 1:2`` agents on loopback that lose a node and gain
one, and Ray Train with ``num_workers=(1, 2)`` on the two-node test cluster.

Every job is started with ``tests/jobs.py`` and ended by pid with everything below it (torchrun's agent starts each
worker in a session of its own, so a session kill would leave it running).
"""

from __future__ import annotations

import json
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.jobs import Job, fabric_command, free_port, job_env, kill_tree, start_job, wait_until

TRAIN = Path(__file__).parent / "scripts" / "elastic_train.py"
#: torch's c10d rendezvous on a busy 2-core machine: a node counts as gone after 5 missed heartbeats 2 s apart (with
#: 1 s x 2 a live agent whose heartbeat thread was starved was dropped, and two worlds formed); a round waits 3 s for
#: more nodes once MIN are there.
RDZV_CONF = "last_call_timeout=3,keep_alive_interval=2,keep_alive_max_attempt=5,join_timeout=120"


def progress(run: Path) -> list[dict]:
    path = run / "progress.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def steps_at(run: Path, world: int, after: float = 0.0) -> list[dict]:
    """Rank 0's steps taken at ``world`` ranks after wall time ``after``."""
    return [r for r in progress(run) if r.get("world") == world and "step" in r and r["t"] > after]


@dataclass
class ScenarioResult:
    run: Path
    outputs: dict[str, str] = field(default_factory=dict)
    codes: dict[str, int] = field(default_factory=dict)
    #: seconds from the failure (a SIGKILL) to rank 0's first step at the smaller size
    shrink_s: float = 0.0
    #: seconds from the start of the new node (agent, Ray node) to rank 0's first step at the larger size
    grow_s: float = 0.0


def restart_scenario(out: Path, strategy: str = "ddp", pause: float = 0.2, timeout: float = 240) -> ScenarioResult:
    """A job restarted by its user or scheduler on fewer ranks: 4 ranks (started as torchrun would) are SIGKILLed
    after 3 steps and 2 ranks started at once; they resume from the last checkpoint."""
    run = out / "slow"
    run.mkdir(parents=True, exist_ok=True)
    result = ScenarioResult(run)

    def ranks(world: int) -> list[Job]:
        port = str(free_port())
        return [
            start_job(
                [sys.executable, str(TRAIN), str(out), strategy, "slow"],
                out / f"w{world}-rank{rank}.log",
                job_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=port, OMP_NUM_THREADS="1", ELASTIC_PAUSE=str(pause)),  # fmt: skip
            )
            for rank in range(world)
        ]

    first: list[Job] = []
    second: list[Job] = []
    try:
        first = ranks(4)
        assert wait_until(lambda: len(steps_at(run, 4)) >= 3, timeout), first[0].output()[-3000:]
        killed = time.time()
        for job in first:
            kill_tree(job.pid)
        second = ranks(2)
        assert wait_until(lambda: steps_at(run, 2, killed), timeout), second[0].output()[-3000:]
        result.shrink_s = steps_at(run, 2, killed)[0]["t"] - killed
        for rank, job in enumerate(second):
            result.codes[f"rank{rank}"] = job.wait(timeout)
    finally:
        for job in first + second:
            kill_tree(job.pid)
        result.outputs = {f"rank{rank}": job.output() for rank, job in enumerate(second)}
    return result


def agents_scenario(out: Path, strategy: str = "ddp", pause: float = 0.2, timeout: float = 240) -> ScenarioResult:
    """Two ``fabric run --num-nodes 1:2`` agents on loopback (one process each) train ``slow`` (see
    ``scripts/elastic_train.py``); the agent that does not host the rendezvous store is SIGKILLed with its worker after
    3 steps at 2 ranks; the other one's worker fails, the agent restarts it alone and it resumes from the last
    checkpoint; after 3 steps at 1 rank a new agent starts, both restart at 2 ranks and finish. The run's gate holds a
    lone rank (before the second node first arrives, and after its 3 steps) so no phase can end the run early."""
    run = out / "slow"
    run.mkdir(parents=True, exist_ok=True)
    gate = run / "gate"
    gate.write_text("1 0")  # a lone first node waits for the second
    port = free_port()
    env = job_env(OMP_NUM_THREADS="1", ELASTIC_PAUSE=str(pause))

    def agent(name: str, hosts_store: bool) -> Job:
        command = [
            *fabric_command(), "--num-nodes", "1:2", "--main-port", port, "--max-restarts", "5",
            "--rdzv-conf", f"{RDZV_CONF},is_host={int(hosts_store)}",  # on loopback every agent would claim the store
            "--accelerator", "cpu", "--strategy", strategy, "--devices", "1", TRAIN, out, strategy, "slow",
        ]  # fmt: skip
        return start_job([str(c) for c in command], out / f"{name}.log", env)

    def listening() -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    result = ScenarioResult(run)
    jobs: dict[str, Job] = {}

    def explain(*names: str) -> str:
        return "\n".join(f"--- agent {n} ---\n{jobs[n].output()[-2500:]}" for n in names if n in jobs)

    try:
        jobs["a"] = agent("a", hosts_store=True)
        assert wait_until(listening, timeout), explain("a")
        jobs["b"] = agent("b", hosts_store=False)
        assert wait_until(lambda: len(steps_at(run, 2)) >= 3, timeout), explain("a", "b")
        gate.write_text("1 3")  # alone, 3 steps, then wait for the new node
        killed = time.time()
        kill_tree(jobs["b"].pid)  # the node fails: its agent and its worker at once
        assert wait_until(lambda: len(steps_at(run, 1, killed)) >= 3, timeout), explain("a")
        result.shrink_s = steps_at(run, 1, killed)[0]["t"] - killed
        joined = time.time()
        jobs["c"] = agent("c", hosts_store=False)
        assert wait_until(lambda: steps_at(run, 2, joined), timeout), explain("a", "c")
        result.grow_s = steps_at(run, 2, joined)[0]["t"] - joined
        for name in ("a", "c"):
            result.codes[name] = jobs[name].wait(timeout)
    finally:
        for job in jobs.values():
            kill_tree(job.pid)
        result.outputs = {name: job.output() for name, job in jobs.items()}
    return result


def ray_scenario(cluster: Any, out: Path, pause: float = 0.2, timeout: float = 420) -> ScenarioResult:
    """``tests/plugins/ray/ray_job.py elastic`` on ``cluster`` (``tests/plugins/ray/conftest.py``): 2 workers, one per
    node; after 3 steps the second node is removed (everything of it SIGKILLed), Ray restarts the group with 1 worker;
    after 3 steps at 1 worker a node is added back and Ray grows the group to 2."""
    run = out / "slow"
    run.mkdir(parents=True, exist_ok=True)
    gate = run / "gate"
    gate.write_text("1 0")  # a lone worker waits for the second node's worker
    result = ScenarioResult(run)
    driver = Path(__file__).parent / "ray" / "ray_job.py"
    job = start_job([sys.executable, str(driver), "elastic", str(out), str(pause)], out / "driver.log", cluster.env())
    try:
        assert wait_until(lambda: len(steps_at(run, 2)) >= 3, timeout), job.output()[-5000:]
        gate.write_text("1 3")
        removed = cluster.remove_second_node()
        assert wait_until(lambda: len(steps_at(run, 1, removed)) >= 3, timeout), job.output()[-5000:]
        result.shrink_s = steps_at(run, 1, removed)[0]["t"] - removed
        added = cluster.add_second_node()
        assert wait_until(lambda: steps_at(run, 2, added), timeout), job.output()[-5000:]
        result.grow_s = steps_at(run, 2, added)[0]["t"] - added
        result.codes["driver"] = job.wait(timeout)
    finally:
        kill_tree(job.pid)
        result.outputs["driver"] = job.output()
    return result
