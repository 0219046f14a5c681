"""Ray: the same 2-process DDP loop (gloo, CPU) under ``fabric run`` (torchrun), ``fabric run --launcher ray`` and
Ray Train's ``TorchTrainer``: steady steps/s of each Ray way over torchrun's, and the seconds from the command's
start to the end of the first optimizer step for all three (Ray's start-up is the user's cost, so it is shown).

The section starts its own one-node Ray cluster (``ray start --head --block``, 2 CPUs, on 127.0.0.2, its own
``RAY_TMPDIR``) before the jobs, reports how long that took, and ends it by its process group and by pid afterwards
(never ``ray stop``: it would end every Ray process on the machine). Each repetition runs the three jobs in rotated
order; every job is ``workers/ray_worker.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._common import (
    REPO_ROOT,
    child_env,
    free_port,
    module_available,
    paired_ratios,
    rotated,
    summarize,
)
from benchmarks.report import stat, table
from benchmarks.section import RenderContext, RunContext, Section, Target

WORKER = REPO_ROOT / "benchmarks" / "workers" / "ray_worker.py"
TORCHRUN, LAUNCHER, TRAINER = "fabric_run", "ray_launcher", "torch_trainer"
WAYS = (TORCHRUN, LAUNCHER, TRAINER)
LABELS = {TORCHRUN: "`fabric run` (torchrun)", LAUNCHER: "`fabric run --launcher ray`", TRAINER: "`TorchTrainer`"}
HEAD_IP = "127.0.0.2"
_PREFIX = "BENCH_JSON "


def unavailable() -> str | None:
    for module in ("fabric_ray", "fabric_ddp", "ray.train"):
        if not module_available(module):
            return f"`{module}` is not importable: install fabric-ray and fabric-ddp"
    return None


def _ray_env(tmpdir: str) -> dict[str, str]:
    env = child_env({"RAY_TMPDIR": tmpdir, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1"})
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "FABRIC_CLI_USED", "RAY_ADDRESS"):
        env.pop(key, None)
    return env


class _Cluster:
    """A one-node Ray cluster for the section, ended by pid."""

    def __init__(self) -> None:
        self.tmpdir = tempfile.mkdtemp(prefix="fb", dir="/tmp")  # short: Ray's socket paths live below it
        self.address = f"{HEAD_IP}:{free_port()}"
        ray = Path(sys.executable).parent / "ray"
        command = [str(ray), "start", "--head", "--node-ip-address", HEAD_IP, "--port", self.address.split(":")[1],
                   "--num-cpus", "2", "--num-gpus", "0", "--object-store-memory", str(100 * 1024 * 1024),
                   "--include-dashboard", "false", "--disable-usage-stats", "--block"]  # fmt: skip
        started = time.perf_counter()
        self.log = open(os.path.join(self.tmpdir, "head.log"), "w")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=_ray_env(self.tmpdir), start_new_session=True)
        probe = f"import ray; ray.init(logging_level='ERROR', _node_ip_address={HEAD_IP!r}); print('CPUS', ray.cluster_resources().get('CPU', 0))"
        deadline = time.monotonic() + 240
        while True:
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the Ray head did not start: {Path(self.tmpdir, 'head.log').read_text()[-2000:]}")
            try:
                out = subprocess.run([sys.executable, "-c", probe], env=self.env(), capture_output=True, text=True, timeout=60).stdout
                if "CPUS 2" in out:
                    break
            except subprocess.TimeoutExpired:
                pass
            time.sleep(1)
        self.start_s = time.perf_counter() - started

    def env(self) -> dict[str, str]:
        return {**_ray_env(self.tmpdir), "RAY_ADDRESS": self.address}

    def close(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
        time.sleep(2)
        marker = self.tmpdir.encode()
        for entry in os.listdir("/proc"):  # Ray's daemons and workers that outlived the head
            if entry.isdigit() and int(entry) != os.getpid():
                try:
                    if marker in Path(f"/proc/{entry}/cmdline").read_bytes():
                        os.kill(int(entry), signal.SIGKILL)
                except (OSError, ProcessLookupError):
                    pass
        self.log.close()
        shutil.rmtree(self.tmpdir, ignore_errors=True)


def _job(way: str, cluster: _Cluster, cfg: dict[str, Any], storage: str) -> dict[str, Any]:
    args = [f"--{k}={cfg[k]}" for k in ("width", "layers", "batch", "warmup", "steps")] + [f"--t0={time.time()!r}"]
    fabric = [sys.executable, "-m", "fabric_core", "run", "--accelerator", "cpu", "--devices", "2"]
    if way == TORCHRUN:
        command = [*fabric, "--main-port", str(free_port()), str(WORKER), "loop", *args]
    elif way == LAUNCHER:
        command = [*fabric, "--launcher", "ray", str(WORKER), "loop", *args]
    else:
        command = [sys.executable, str(WORKER), "trainer", "--address", cluster.address, "--node-ip", HEAD_IP, "--storage", storage, *args]
    env = cluster.env()
    proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=cfg["timeout"])
    for line in reversed(proc.stdout.splitlines()):
        text = line.split("] ", 1)[1] if line.startswith("[rank 0] ") else line
        if text.startswith(_PREFIX):
            return json.loads(text[len(_PREFIX) :])
    raise RuntimeError(f"{way} job exited with {proc.returncode} and no result:\n{(proc.stderr or proc.stdout)[-2500:]}")


def run(ctx: RunContext) -> dict[str, Any]:
    cfg = dict(ctx.config)
    cluster = _Cluster()
    ctx.log(f"  ray: one-node cluster up in {cluster.start_s:.1f} s")
    samples: dict[str, list[dict[str, Any]]] = {way: [] for way in WAYS}
    storage = tempfile.mkdtemp(prefix="fabric-ray-bench-")
    try:
        for rep in range(cfg["reps"]):
            for way in rotated(WAYS, rep):
                samples[way].append(_job(way, cluster, cfg, storage))
                ctx.log(f"  ray rep {rep}: {way} {samples[way][-1]}")
    finally:
        cluster.close()
        shutil.rmtree(storage, ignore_errors=True)
    steps = {way: [s["steps_per_s"] for s in samples[way]] for way in WAYS}
    return {
        "config": cfg,
        "cluster_start_s": cluster.start_s,
        "steps_per_s": {way: summarize(steps[way]) for way in WAYS},
        "first_step_s": {way: summarize([s["first_step_s"] for s in samples[way]]) for way in WAYS},
        "steps_ratio": {way: paired_ratios(steps[way], steps[TORCHRUN]) for way in (LAUNCHER, TRAINER)},
    }


def render(result: dict[str, Any], ctx: RenderContext) -> str:
    cfg = result["config"]
    lines = [
        "### Ray: `fabric run --launcher ray` and `TorchTrainer` vs `fabric run` (torchrun)",
        "",
        f"2-process DDP on CPU (gloo, one thread per process), an MLP of {cfg['layers']} x {cfg['width']}, batch"
        f" {cfg['batch']}, {cfg['steps']} timed steps after {cfg['warmup']}; {cfg['reps']} repetition(s), the three ways"
        f" in rotated order. A one-node Ray cluster (2 CPUs) was started first, in {result['cluster_start_s']:.1f} s (not"
        " counted below). First step: seconds from the command's start to the end of the first optimizer step.",
        "",
    ]
    rows = []
    for way in WAYS:
        ratio = result["steps_ratio"].get(way)
        rows.append([LABELS[way], stat(result["steps_per_s"][way]), stat(ratio) if ratio else "1 (baseline)", stat(result["first_step_s"][way])])
    lines += table(["launch", "steps/s", "steps/s vs torchrun", "first step (s)"], rows)
    return "\n".join(lines) + "\n"


SECTION = Section(
    name="ray",
    order=90,
    modes={
        "full": {"reps": 5, "width": 256, "layers": 4, "batch": 64, "warmup": 20, "steps": 1000, "timeout": 600},
        "quick": {"reps": 1, "width": 256, "layers": 4, "batch": 64, "warmup": 10, "steps": 100, "timeout": 600},
        "tiny": {"reps": 1, "width": 32, "layers": 1, "batch": 8, "warmup": 1, "steps": 3, "timeout": 600},
    },
    run=run,
    render=render,
    targets=(
        Target("ray_launcher_steps", "steady steps/s, `fabric run --launcher ray` / `fabric run`", ("steps_ratio",), ">=", 0.98, variant=LAUNCHER, comparator=None),
        Target("ray_trainer_steps", "steady steps/s, `TorchTrainer` / `fabric run`", ("steps_ratio",), ">=", 0.98, variant=TRAINER, comparator=None),
    ),
    isolated=True,
    unavailable=unavailable,
    compares_lightning=False,
    timeout_s=3600,
)
