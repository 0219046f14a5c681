"""A real two-node Ray cluster on loopback, one per test module, that leaves no Ray process behind.

Both nodes are ``ray start ... --block`` processes started as jobs of their own (``tests/jobs.py``), on loopback,
with 2 CPUs and a 100 MB object store each (the machine is shared), usage stats off and a short ``RAY_TMPDIR`` of
their own (Unix socket paths have a length limit). The second node joins only with ``RAY_AUTH_MODE=disabled`` on this
Ray (measured). Teardown ends both with SIGTERM (``--block`` then stops what it started), kills by pid whatever
still runs with the cluster's temporary folder in its command line (Ray's daemons and workers), and fails the
module's last test if anything had to be killed or survived. Never ``ray stop``: it ends every Ray process on the
machine, other people's included. A test process that is killed (no teardown) still stops both nodes: each gets
SIGTERM when it dies.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.jobs import free_port, job_env, kill_session, kill_tree, session_processes, start_job, wait_until

RAY = Path(sys.executable).parent / "ray"
NODE_CPUS = 2
OBJECT_STORE_BYTES = 100 * 1024 * 1024
START_TIMEOUT = 180.0  # a busy shared machine: the second node took over 90 s to reach the head once

@dataclass
class RayCluster:
    address: str
    tmpdir: Path
    #: every node started for the cluster (a removed one stays listed: teardown ends whatever is left of it)
    nodes: list = field(default_factory=list)
    logs: Path | None = None

    def remove_second_node(self) -> float:
        """The second node fails: its ``ray start`` and everything below it (raylet, Ray's workers) SIGKILLed at once.
        Returns the wall time of the kill."""
        node = self.nodes[-1]
        killed = time.time()
        kill_tree(node.pid)
        for pid in cluster_processes(self.tmpdir):  # whatever of that node left its process tree (Ray's workers)
            if SECOND_IP in _command_line(pid):
                kill_tree(pid)
        assert wait_until(lambda: _alive_nodes(self) == 1, START_TIMEOUT, 1.0), "Ray still counts the removed node"
        return killed

    def add_second_node(self) -> float:
        """A new second node joins (same address as the removed one); returns the wall time it was started."""
        started = time.time()
        log = (self.logs or self.tmpdir) / f"node2-{len(self.nodes)}.log"
        self.nodes.append(_node(self.tmpdir, log, SECOND_IP, "--address", self.address))
        assert wait_until(lambda: _alive_nodes(self) == 2, START_TIMEOUT, 1.0), self.nodes[-1].output()[-3000:]
        return started

    def env(self, **extra: str) -> dict[str, str]:
        """A job's environment that reaches this cluster (and only it)."""
        return job_env(
            RAY_ADDRESS=self.address,
            RAY_TMPDIR=str(self.tmpdir),
            RAY_USAGE_STATS_ENABLED="0",
            RAY_AUTH_MODE="disabled",
            TEST_RAY_NODE_IP=HEAD_IP,  # the driver joins through the head node
            OMP_NUM_THREADS="1",
            PYTHONWARNINGS="ignore",
            **extra,
        )

def cluster_processes(tmpdir: Path) -> list[int]:
    """Live processes whose command line names the cluster's temporary folder (Ray's daemons and workers)."""
    marker = str(tmpdir).encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if marker in cmdline and state not in ("Z", "X"):
            found.append(int(entry))
    return found

#: The nodes' addresses, on loopback. Two, because Ray Train numbers nodes by their IP (one IP = one node for node
#: and local ranks); and not 127.0.0.1, which ``ray start`` replaces by the machine's outward address.
HEAD_IP, SECOND_IP = "127.0.0.2", "127.0.0.3"


def _node(tmpdir: Path, log: Path, ip: str, *args: str):
    command = [
        str(RAY), "start", "--node-ip-address", ip, "--num-cpus", str(NODE_CPUS), "--num-gpus", "0",
        "--object-store-memory", str(OBJECT_STORE_BYTES), "--disable-usage-stats", "--block", *args,
    ]  # fmt: skip
    env = job_env(
        RAY_TMPDIR=str(tmpdir),
        RAY_USAGE_STATS_ENABLED="0",
        RAY_AUTH_MODE="disabled",
        OMP_NUM_THREADS="1",
        # Ray's default (30 s) for a raylet to register with the GCS was too short here once under load (exit 1,
        # "The current node timed out during startup"): START_TIMEOUT bounds the whole start anyway.
        RAY_raylet_start_wait_time_s=str(int(START_TIMEOUT)),
    )
    return start_job(command, log, env, ends_with_test=True)  # a killed test run stops the node (its --block handler)

def _alive_nodes(cluster: RayCluster) -> int:
    code = f"import ray; ray.init(logging_level='ERROR', _node_ip_address={HEAD_IP!r}); print('NODES', sum(n['Alive'] for n in ray.nodes()))"
    try:
        out = subprocess.run(
            [sys.executable, "-c", code], env=cluster.env(), capture_output=True, text=True, timeout=60
        ).stdout
    except subprocess.TimeoutExpired:
        return 0
    for line in out.splitlines():
        if line.startswith("NODES "):
            return int(line.split()[1])
    return 0

def _diagnosis(tmpdir: Path, *jobs) -> str:
    """The nodes' output and the tails of Ray's own daemon logs (the test's folders may be gone by the time one looks)."""
    parts = [f"--- {job.log.name} (exit {job.process.poll()}) ---\n{job.output()[-2000:]}" for job in jobs]
    for log in sorted((tmpdir / "ray" / "session_latest" / "logs").glob("*")):
        if log.suffix in (".err", ".out", ".log") and log.stat().st_size and ("gcs" in log.name or "raylet" in log.name or "exit" in log.name):
            parts.append(f"--- {log.name} ---\n{log.read_text(errors='replace')[-1500:]}")
    return "\n".join(parts)


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayCluster]:
    with running_cluster(tmp_path_factory.mktemp("ray-cluster")) as cluster:
        yield cluster


@contextmanager
def running_cluster(logs: Path) -> Iterator[RayCluster]:
    """The two-node cluster for as long as the block runs (the fixture's; the ``elastic`` benchmark section's too)."""
    tmpdir = Path(tempfile.mkdtemp(prefix="fr", dir="/tmp"))  # short: Ray's socket paths live below it
    port = free_port()
    cluster = RayCluster(f"{HEAD_IP}:{port}", tmpdir, logs=logs)
    head = _node(tmpdir, logs / "head.log", HEAD_IP, "--head", "--port", str(port), "--include-dashboard", "false")
    cluster.nodes.append(head)
    worker = None
    try:
        assert wait_until(lambda: (tmpdir / "ray" / "session_latest").exists(), START_TIMEOUT, 0.5), head.output()[-3000:]
        worker = _node(tmpdir, logs / "node2.log", SECOND_IP, "--address", cluster.address)
        cluster.nodes.append(worker)
        deadline = time.monotonic() + START_TIMEOUT
        while _alive_nodes(cluster) < 2:
            assert time.monotonic() < deadline, f"the second node did not join:\n{_diagnosis(tmpdir, head, worker)}"
            assert head.process.poll() is None and worker.process.poll() is None, _diagnosis(tmpdir, head, worker)
            time.sleep(1)
        yield cluster
    finally:
        started = list(reversed(cluster.nodes))  # the head last
        for job in started:
            if job.process.poll() is None:
                os.killpg(job.pid, signal.SIGTERM)
        for job in started:
            try:
                job.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                kill_session(job.pid)
        def remaining() -> list[int]:
            # Ray's workers rename themselves (`ray::IDLE`): they are found by session, and may still be exiting
            return cluster_processes(tmpdir) + [p for j in started for p in session_processes(j.pid)]

        wait_until(lambda: not remaining(), 40, 0.5)
        left = remaining()
        described = {pid: _command_line(pid) for pid in sorted(set(left))}
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(tmpdir, ignore_errors=True)
        assert not left, f"Ray processes left behind by the test cluster (killed now): {described}"


def _command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:300]
    except OSError:
        return "?"
